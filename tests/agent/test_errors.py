"""Error files (torch's @record format) and failure reports."""

from __future__ import annotations

import json
import os
import tracemalloc
from pathlib import Path

from aelastic.agent import RunResult, WorkerState
from aelastic.agent.health.errors import (
    NOT_KEPT,
    SHOWN_WIDTH,
    bounded,
    format_failures,
    make_failure,
    printable,
    read_error_file,
)


def failure(tmp_path: Path, content: str | None, exitcode: int = 1, when: float = 100.0):  # type: ignore[no-untyped-def]
    path = tmp_path / f"error-{when}.json"
    if content is not None:
        path.write_text(content)
    return make_failure(
        local_rank=0,
        global_rank=3,
        pid=42,
        exitcode=exitcode,
        error_file=str(path),
        role="trainer",
        timestamp=when,
    )


def test_torch_record_format(tmp_path: Path) -> None:
    doc = {
        "message": {
            "message": "ValueError: boom",
            "extraInfo": {"py_callstack": "Traceback...\nValueError: boom\n", "timestamp": "7"},
        }
    }
    f = failure(tmp_path, json.dumps(doc))
    assert f.message == "ValueError: boom"
    assert f.error_file_data == doc
    assert f.error_file.endswith(".json")
    assert "Traceback..." in format_failures(RunResult(WorkerState.FAILED, failures={3: f}))


def test_old_string_format(tmp_path: Path) -> None:
    assert failure(tmp_path, '{"message": "old style", "timestamp": 5}').message == "old style"


def test_missing_empty_or_corrupt_files_still_report(tmp_path: Path) -> None:
    missing = failure(tmp_path, None, exitcode=-9)
    assert missing.message == "Signal 9 (SIGKILL) received by PID 42"
    assert missing.error_file == "<N/A>"
    assert failure(tmp_path, None, exitcode=2).message.startswith("To enable traceback")
    assert failure(tmp_path, "", when=1).error_file == "<N/A>"
    assert "is not JSON" in failure(tmp_path, "{oops", when=2).message
    assert "not an object" in failure(tmp_path, "[1]", when=3).message
    assert read_error_file("") is None
    assert read_error_file(os.devnull) is None


def test_root_cause_is_the_earliest(tmp_path: Path) -> None:
    late = failure(tmp_path, None, when=200.0)
    early = make_failure(
        local_rank=1, global_rank=4, pid=43, exitcode=3, error_file="", role="t", timestamp=150.0
    )
    result = RunResult(WorkerState.FAILED, failures={3: late, 4: early})
    assert result.root_cause is early
    report = format_failures(result, "trainer")
    assert (
        report.index("rank      : 3") < report.index("Root Cause") < report.index("rank      : 4")
    )
    assert RunResult(WorkerState.SUCCEEDED).root_cause is None
    assert "no failures" in format_failures(RunResult(WorkerState.SUCCEEDED))
    assert late.signal_name() == "<N/A>" and "exitcode 1" in str(late)


def test_a_huge_error_file_is_not_read_whole(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    message = "ValueError: \x1b[2J" + "x" * (50 * 1024 * 1024)
    path.write_text(json.dumps({"message": {"message": message}}))
    tracemalloc.start()
    try:
        read = read_error_file(str(path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert read is not None and peak < 1024 * 1024  # 50 MB on disk, its head in memory
    text, data = read
    assert data == {} and len(text) < 10_000
    size = path.stat().st_size
    assert text.endswith(f"<error file {path}: {size} bytes, too large to read whole>")


def test_reports_show_the_first_lines_escaped_and_where_the_rest_is(tmp_path: Path) -> None:
    stack = "".join(f"line {i} \x1b[31mred\x1b[0m\r\n" for i in range(1000)) + "y" * 10_000
    doc = {"message": {"message": "E: \x1b]0;title\x07", "extraInfo": {"py_callstack": stack}}}
    f = failure(tmp_path, json.dumps(doc))
    report = format_failures(RunResult(WorkerState.FAILED, failures={3: f}))
    assert "\x1b" not in report and "\x07" not in report and "\r" not in report
    assert "line 0 \\x1b[31mred\\x1b[0m\\x0d" in report
    assert "line 39 " in report and "line 40 " not in report
    assert f"... (cut: see {f.error_file})" in report
    assert len(report) < 40 * (SHOWN_WIDTH + 100)
    shown = bounded("a" * 2 * SHOWN_WIDTH, NOT_KEPT)
    assert shown == f"{'a' * SHOWN_WIDTH}... ({SHOWN_WIDTH} more characters)\n... (cut: not kept)"
    assert bounded("short\ttab\n", "x") == "short\ttab"
    assert printable("\x9b2J\x00ok\n") == "\\x9b2J\\x00ok\n"
