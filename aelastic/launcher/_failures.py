"""How a failed launch is reported the way torch reports it: ``ChildFailedError``, error files.

How it works: :func:`child_failed_error` makes torch's own
``torch.distributed.elastic.multiprocessing.errors.ChildFailedError`` when torch can be
imported (only then, on a failure: the launcher never imports torch otherwise), so an
existing ``except ChildFailedError`` catches it; without torch, :class:`ChildFailedError`
here, with the same attributes and message. Its ``failures`` map global ranks to
:class:`ChildFailure`, shaped as torch's ``ProcessFailure`` (``message`` is the error file's
``message`` object when the worker wrote one, so the traceback shows in the message as
under torch). :func:`write_root_cause` and :func:`record_exception` write the launcher's own
``TORCHELASTIC_ERROR_FILE`` in the format torch's ``@record`` uses (TorchX reads it).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from ..agent import ProcessFailure

__all__ = [
    "ChildFailedError",
    "ChildFailure",
    "child_failed_error",
    "child_failed_error_class",
    "entrypoint_name",
    "record_exception",
    "write_root_cause",
]

_NOT_AVAILABLE = "<N/A>"
#: The name of torch's variable for a process' error file.
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"


@dataclass(frozen=True)
class ChildFailure:
    """A failed worker as torch's ``ProcessFailure`` shows it (plus aelastic's fields)."""

    local_rank: int
    pid: int
    exitcode: int
    error_file: str
    message: Any
    timestamp: float
    error_file_data: Mapping[str, Any] = field(default_factory=dict)
    global_rank: int = -1
    role: str = ""
    hostname: str = ""

    @classmethod
    def of(cls, failure: ProcessFailure) -> ChildFailure:
        """torch's view of an aelastic failure."""
        data = dict(failure.error_file_data)
        message: Any = data.get("message") if data.get("message") else failure.message
        path = failure.error_file if os.path.isfile(failure.error_file) else _NOT_AVAILABLE
        return cls(
            local_rank=failure.local_rank,
            pid=failure.pid,
            exitcode=failure.exitcode,
            error_file=path,
            message=message,
            timestamp=failure.timestamp,
            error_file_data=data or {"message": "<NONE>"},
            global_rank=failure.global_rank,
            role=failure.role,
            hostname=failure.hostname,
        )

    def signal_name(self) -> str:
        if self.exitcode < 0:
            try:
                return signal.Signals(-self.exitcode).name
            except ValueError:
                return _NOT_AVAILABLE
        return _NOT_AVAILABLE

    def timestamp_isoformat(self) -> str:
        return datetime.fromtimestamp(int(self.timestamp)).isoformat(sep="_")


class ChildFailedError(Exception):
    """Workers failed (torch's ``ChildFailedError``, raised when torch is not installed).

    Args:
        name: The entrypoint's name.
        failures: The failures by global rank (not empty).
    """

    def __init__(self, name: str, failures: dict[int, Any]) -> None:
        if not failures:
            raise ValueError("a ChildFailedError needs at least one failure")
        self.name = name
        self.failures = failures
        super().__init__(self.format_msg())

    def get_first_failure(self) -> tuple[int, Any]:
        """The global rank and failure of the earliest failure (the root cause)."""
        rank = min(self.failures, key=lambda r: self.failures[r].timestamp)
        return rank, self.failures[rank]

    def format_msg(self, boarder_delim: str = "=", section_delim: str = "-") -> str:
        """The report torch's class makes: the other failures, then the root cause."""
        title = f"{self.name} FAILED"
        root, _ = self.get_first_failure()
        blocks = {rank: _format(i, rank, f) for i, (rank, f) in enumerate(self.failures.items())}
        width = min(max(len(title), *(len(x) for b in blocks.values() for x in b.split("\n"))), 60)
        others = [b for rank, b in blocks.items() if rank != root] or ["  <NO_OTHER_FAILURES>"]
        return "\n".join(
            [
                "",
                boarder_delim * width,
                title,
                section_delim * width,
                "Failures:",
                *others,
                section_delim * width,
                "Root Cause (first observed failure):",
                blocks[root],
                boarder_delim * width,
            ]
        )


def _format(index: int, rank: int, failure: Any) -> str:
    message = failure.message
    if isinstance(message, dict):
        stack = message.get("extraInfo", {}).get("py_callstack", message.get("message", "<N/A>"))
        message = str(stack).replace("\n", "\n  ")
    name = failure.signal_name()
    signal_part = f" ({name})" if name != _NOT_AVAILABLE else ""
    return (  # torch's layout, to the space
        f"[{index}]:\n"
        f"  time      : {failure.timestamp_isoformat()}\n"
        f"  host      : {_hostname()}\n"
        f"  rank      : {rank} (local_rank: {failure.local_rank})\n"
        f"  exitcode  : {failure.exitcode} (pid: {failure.pid}) {signal_part}\n"
        f"  error_file: {failure.error_file}\n"
        f"  traceback : {message}"
    )


def _hostname() -> str:
    import socket

    return socket.getfqdn()


def child_failed_error_class() -> type[Exception]:
    """torch's ``ChildFailedError`` when torch can be imported, else aelastic's."""
    try:
        from torch.distributed.elastic.multiprocessing.errors import (
            ChildFailedError as TorchChildFailedError,
        )
    except ImportError:
        return ChildFailedError
    cls: type[Exception] = TorchChildFailedError
    return cls


def child_failed_error(name: str, failures: Mapping[int, ProcessFailure]) -> Exception:
    """The exception torch's launcher raises for ``failures`` (by global rank)."""
    shaped = {rank: ChildFailure.of(f) for rank, f in sorted(failures.items())}
    cls: Callable[..., Exception] = child_failed_error_class()
    return cls(name=name, failures=shaped)


def entrypoint_name(entrypoint: Callable[..., Any] | str | None, args: list[Any]) -> str:
    """torch's name of an entrypoint: a function's ``__name__``; for ``sys.executable``, the
    first argument that is not an option; else the command."""
    if callable(entrypoint):
        return str(getattr(entrypoint, "__name__", repr(entrypoint)))
    if isinstance(entrypoint, str):
        if entrypoint == sys.executable:
            return next((str(a) for a in args if not str(a).startswith("-")), "")
        return entrypoint
    return ""


def _error_file() -> str | None:
    path = os.environ.get(ERROR_FILE_ENV)
    return path if path and path != os.devnull else None


def write_root_cause(failure: ProcessFailure) -> str | None:
    """Copy the root cause's error data into this process' ``TORCHELASTIC_ERROR_FILE`` (as
    torch's ``@record`` does, with the exit code as ``errorCode``); the path written, or
    ``None`` when the variable is unset or the worker wrote no error file."""
    path = _error_file()
    data = json.loads(json.dumps(dict(failure.error_file_data)))  # a deep copy
    if path is None or not data:
        return None
    message = data.get("message")
    if isinstance(message, dict) and failure.exitcode:
        message["errorCode"] = failure.exitcode
    _write(path, data)
    return path


def record_exception(exc: BaseException) -> str | None:
    """Write ``exc`` to this process' ``TORCHELASTIC_ERROR_FILE`` as torch's ``@record``
    does; the path written, or ``None`` when the variable is unset."""
    path = _error_file()
    if path is None:
        return None
    stack = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    info = {"py_callstack": stack, "timestamp": str(int(time.time()))}
    _write(path, {"message": {"message": f"{type(exc).__name__}: {exc}", "extraInfo": info}})
    return path


def _write(path: str, data: Mapping[str, Any]) -> None:
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError as exc:
        print(f"aelastic: cannot write the error file {path}: {exc}", file=sys.stderr)
