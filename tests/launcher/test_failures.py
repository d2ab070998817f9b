"""ChildFailedError without torch: aelastic's class has torch's attributes and message."""

from __future__ import annotations

import sys

import pytest
import torch.distributed.elastic.multiprocessing.errors as torch_errors

from aelastic.agent import ProcessFailure
from aelastic.launcher import _failures

CALLSTACK = 'Traceback (most recent call last):\n  File "t.py", line 1\nValueError: v\n'


def _failures_by_rank() -> dict[int, ProcessFailure]:
    data = {
        "message": {
            "message": "ValueError: v",
            "extraInfo": {"py_callstack": CALLSTACK, "timestamp": "1"},
        }
    }
    return {
        1: ProcessFailure(1, 1, 101, 1, "ValueError: v", 1000.5, "/gone", data, "r", "h"),
        0: ProcessFailure(0, 0, 100, -9, "Signal 9 (SIGKILL)", 1001.0, "<N/A>", {}, "r", "h"),
    }


def test_without_torch_the_class_is_aelastics_with_torchs_message(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "torch.distributed.elastic.multiprocessing.errors", None)
    error = _failures.child_failed_error("train", _failures_by_rank())
    assert type(error) is _failures.ChildFailedError
    monkeypatch.undo()
    theirs = torch_errors.ChildFailedError("train", error.failures)  # type: ignore[attr-defined]
    assert str(error) == str(theirs)
    rank, first = error.get_first_failure()  # type: ignore[attr-defined]
    assert rank == 1 and first.message["message"] == "ValueError: v"
    assert first.error_file == "<N/A>"  # a file that is gone is not named (torch's @record)
    assert error.failures[0].signal_name() == "SIGKILL"  # type: ignore[attr-defined]


def test_a_child_failed_error_needs_failures() -> None:
    with pytest.raises(ValueError, match="at least one failure"):
        _failures.ChildFailedError("train", {})
