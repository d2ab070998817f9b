"""Worker failures: read the error file torch's ``@record`` writes, describe, pick the root cause.

How it works: a worker wrapped in ``torch.distributed.elastic.multiprocessing.errors.record``
writes ``{"message": {"message": ..., "extraInfo": {"py_callstack": ..., "timestamp": ...}}}``
(or the older ``{"message": "...", "timestamp": ...}``) to ``TORCHELASTIC_ERROR_FILE``
when it dies of an exception. :func:`make_failure` turns an exit status plus that file into a
:class:`~aelastic.agent.api.ProcessFailure`; a missing, empty or unreadable file never hides
the failure itself, it only leaves a generated message. When the agent's log directory is
a temporary one (no ``log_dir``), it is removed with the run: the failures then name their
error file :data:`NOT_KEPT`, and the content stays in ``error_file_data`` (reports show it,
see :func:`error_details`). What a worker wrote is shown bounded (:func:`bounded`: the first
lines, each cut, then where the rest is) with its control characters escaped (a terminal
escape sequence shows as ``\x1b[2J``, it is not obeyed); a file larger than
:data:`MAX_READ` is not read whole, only its beginning is shown.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from .api import ProcessFailure, RunResult, WorkerSpec, std_map

__all__ = [
    "MAX_READ",
    "NOT_KEPT",
    "SHOWN_LINES",
    "SHOWN_WIDTH",
    "bounded",
    "error_details",
    "format_failures",
    "kept_failures",
    "logs_disposable",
    "make_failure",
    "printable",
    "read_error_file",
]

_NOT_AVAILABLE = "<N/A>"
#: ``ProcessFailure.error_file`` of an error file removed with the agent's temporary logs.
NOT_KEPT = "<not kept: no log_dir>"
_NO_TRACEBACK = "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
#: Bytes of an error file read whole; of a larger one only the first :data:`_HEAD` are.
MAX_READ = 1024 * 1024
_HEAD = 4096
#: Lines, and characters per line, of what a worker wrote that a report shows.
SHOWN_LINES = 40
SHOWN_WIDTH = 500
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """``text`` with its control characters escaped (``\\x1b``): a terminal shows them, it
    does not obey them. Newlines and tabs stay."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def bounded(text: str, error_file: str, lines: int = SHOWN_LINES, width: int = SHOWN_WIDTH) -> str:
    """At most ``lines`` lines of ``text``, each cut at ``width`` characters, control
    characters escaped; when something was left out, a last line says where it is."""
    kept: list[str] = []
    cut = False
    for index, line in enumerate(text.rstrip("\n").split("\n")):
        if index == lines:
            cut = True
            break
        if len(line) > width:
            line, cut = f"{line[:width]}... ({len(line) - width} more characters)", True
        kept.append(printable(line))
    if cut:
        where = "not kept" if error_file == NOT_KEPT else f"see {error_file}"
        kept.append(f"... (cut: {where})")
    return "\n".join(kept)


def read_error_file(path: str) -> tuple[str, dict[str, Any]] | None:
    """The message and the whole document of an error file, or ``None`` if there is none.

    A file that exists but is not the expected JSON gives a message saying so (the
    failure is still reported, with what could be read).
    """
    if not path or path == os.devnull:
        return None
    try:
        with open(path, encoding="utf-8", errors="replace") as fp:
            size = os.fstat(fp.fileno()).st_size
            text = fp.read(MAX_READ + 1 if size <= MAX_READ else _HEAD)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"<error file {path} unreadable: {exc}>", {}
    if not text.strip():
        return None
    if size > MAX_READ:  # not read whole: its beginning, and where the rest is
        return f"{text}\n<error file {path}: {size} bytes, too large to read whole>", {}
    try:
        data = json.loads(text)
    except ValueError:
        return f"<error file {path} is not JSON: {text[:200]!r}>", {}
    if not isinstance(data, dict):
        return f"<error file {path} holds {type(data).__name__}, not an object>", {}
    message = data.get("message")
    if isinstance(message, dict):
        inner = message.get("message")
        return (str(inner) if inner is not None else json.dumps(message)), data
    if isinstance(message, str):
        return message, data
    return json.dumps(data)[:2000], data


def make_failure(
    *,
    local_rank: int,
    global_rank: int,
    pid: int,
    exitcode: int,
    error_file: str,
    role: str,
    timestamp: float | None = None,
) -> ProcessFailure:
    """Describe a worker that exited with ``exitcode`` (negative: killed by that signal)."""
    when = time.time() if timestamp is None else timestamp
    read = read_error_file(error_file)
    if read is not None:
        message, data = read
        shown_file = error_file
    else:
        data, shown_file = {}, _NOT_AVAILABLE
        if exitcode < 0:
            message = f"Signal {-exitcode} ({_signal_name(-exitcode)}) received by PID {pid}"
        else:
            message = _NO_TRACEBACK
    return ProcessFailure(
        local_rank=local_rank,
        global_rank=global_rank,
        pid=pid,
        exitcode=exitcode,
        message=message,
        timestamp=when,
        error_file=shown_file,
        error_file_data=data,
        role=role,
    )


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return _NOT_AVAILABLE


def format_failures(result: RunResult, name: str = "worker") -> str:
    """A readable report of ``result``'s failures, root cause last (like torch's)."""
    root = result.root_cause
    if root is None:
        return f"{name}: no failures"
    lines = [f"{name} FAILED", "Failures:"]
    others = [f for f in _by_time(result.failures) if f is not root]
    lines.extend(_describe(i + 1, f) for i, f in enumerate(others))
    if not others:
        lines.append("  <NO_OTHER_FAILURES>")
    lines.append("Root Cause (first observed failure):")
    lines.append(_describe(0, root))
    return "\n".join(lines)


def _by_time(failures: Mapping[int, ProcessFailure]) -> list[ProcessFailure]:
    return sorted(failures.values(), key=lambda f: (f.timestamp, f.global_rank))


def error_details(failure: ProcessFailure) -> str:
    """What the worker's error file said: its call stack when it has one, else the message."""
    message = failure.error_file_data.get("message")
    extra = message.get("extraInfo") if isinstance(message, dict) else None
    stack = extra.get("py_callstack") if isinstance(extra, dict) else None
    return stack.rstrip() if isinstance(stack, str) and stack.strip() else failure.message


def _describe(index: int, failure: ProcessFailure) -> str:
    signal_part = f" ({failure.signal_name()})" if failure.exitcode < 0 else ""
    message = bounded(error_details(failure), failure.error_file).replace("\n", "\n    ")
    return (
        f"[{index}]:\n"
        f"  time      : {failure.timestamp_isoformat()}\n"
        f"  host      : {failure.hostname}\n"
        f"  rank      : {failure.global_rank} (local_rank: {failure.local_rank})\n"
        f"  exitcode  : {failure.exitcode} (pid: {failure.pid}){signal_part}\n"
        f"  error_file: {failure.error_file}\n"
        f"  traceback : {message}"
    )


def logs_disposable(spec: WorkerSpec) -> bool:
    """Whether a log root the agent made holds only error files (already read): nothing of
    the workers' output was redirected into it."""
    n = spec.local_world_size
    redirected = [*std_map(spec.redirects, n).values(), *std_map(spec.tee, n).values()]
    return not any(redirected)


def kept_failures(
    spec: WorkerSpec, own_log_root: str | None, failures: Mapping[int, ProcessFailure]
) -> dict[int, ProcessFailure]:
    """``failures`` as reported: error files removed with the run are named so, not by a
    path that will not exist (their content stays in ``error_file_data``)."""
    if own_log_root is None or not logs_disposable(spec):
        return dict(failures)
    return {
        rank: f if f.error_file in ("", "<N/A>") else replace(f, error_file=NOT_KEPT)
        for rank, f in failures.items()
    }
