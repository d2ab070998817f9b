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

Without an error file, a worker whose stderr goes to a log file (``--redirects``/``--tee``)
is described by the last lines it wrote there (:func:`stderr_tail`, bounded).
:func:`raised_in_collective` tells a failure that broke inside ``torch.distributed`` (most
likely because a peer failed first) from the worker's own.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from ..api import ProcessFailure, RunResult, WorkerSpec, std_map

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
    "raised_in_collective",
    "read_error_file",
    "stderr_tail",
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
    stderr_log: str | None = None,
) -> ProcessFailure:
    """Describe a worker that exited with ``exitcode`` (negative: killed by that signal);
    ``stderr_log``: the file its stderr went to, if any (its tail is the message when
    there is no error file)."""
    when = time.time() if timestamp is None else timestamp
    read = read_error_file(error_file)
    tail = "" if read is not None or not stderr_log else stderr_tail(stderr_log)
    if read is not None:
        message, data = read
        shown_file = error_file
    else:
        data, shown_file = {}, _NOT_AVAILABLE
        if tail:
            message = tail
        elif exitcode < 0:
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
        secondary=raised_in_collective(message if tail else _callstack(data) or message),
    )


#: Lines and bytes of a stderr log's end read for a failure without an error file.
_TAIL_LINES = 20
_TAIL_BYTES = 8192


def stderr_tail(path: str) -> str:
    """The last lines (at most 20, from the last 8 KiB) of a worker's stderr log."""
    try:
        with open(path, "rb") as fp:
            fp.seek(0, os.SEEK_END)
            size = fp.tell()
            fp.seek(max(size - _TAIL_BYTES, 0))
            data = fp.read(_TAIL_BYTES)
    except OSError:
        return ""
    lines = data.decode(errors="replace").rstrip().splitlines()
    if size > _TAIL_BYTES:
        lines = lines[1:]  # the first one was cut
    return "\n".join(lines[-_TAIL_LINES:])


def _callstack(data: Mapping[str, Any]) -> str:
    message = data.get("message")
    extra = message.get("extraInfo") if isinstance(message, dict) else None
    stack = extra.get("py_callstack") if isinstance(extra, dict) else None
    return stack if isinstance(stack, str) else ""


_TRACEBACK_FRAME = re.compile(r'^\s*File "([^"]*)", line \d+')
_PEER_ERRORS = ("Connection closed by peer", "Connection reset by peer", "NCCL communicator")


def raised_in_collective(traceback_text: str) -> bool:
    """Whether a Python traceback's innermost frame is inside ``torch.distributed``, or its
    message is one a collective gives when a peer is gone."""
    frames = [
        m.group(1) for line in traceback_text.splitlines() if (m := _TRACEBACK_FRAME.match(line))
    ]
    if frames and os.path.join("torch", "distributed", "") in frames[-1]:
        return True
    return any(marker in traceback_text for marker in _PEER_ERRORS)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return _NOT_AVAILABLE


def format_failures(
    result: RunResult,
    name: str = "worker",
    *,
    shown: Callable[[ProcessFailure], bool] | None = None,
) -> str:
    """``result``'s failures in the shape of torch's report (``ChildFailedError``'s message):
    ``<name> FAILED``, the other failures, then the root cause, between rules.

    Args:
        result: The run's result.
        name: The title's name (torch's: the entrypoint, ``train.py``).
        shown: Whether a failure's stderr reached the console: then the traceback of an
            uncaught exception (exit code 1) is in the worker's output already, and its
            ``traceback`` line holds the exception only.
    """
    root = result.root_cause
    if root is None:
        return f"{name}: no failures"
    title = f"{name} FAILED"
    root_block, others = "", []
    for index, failure in enumerate(sorted(result.failures.values(), key=_rank)):
        block = _describe(index, failure, shown is not None and shown(failure))
        if failure is root:
            root_block = block
        else:
            others.append(block)
    blocks = [title, root_block, *others]
    width = min(max(len(line) for block in blocks for line in block.split("\n")), _WIDTH)
    return "\n".join(
        [
            "=" * width,
            title,
            "-" * width,
            "Failures:",
            *(others or ["  <NO_OTHER_FAILURES>"]),
            "-" * width,
            "Root Cause (first observed failure):",
            root_block,
            "=" * width,
        ]
    )


#: The widest rule of a report (torch's).
_WIDTH = 60


def _rank(failure: ProcessFailure) -> int:
    return failure.global_rank


def error_details(failure: ProcessFailure) -> str:
    """What the worker's error file said: its call stack when it has one, else the message."""
    stack = _callstack(failure.error_file_data)
    return stack.rstrip() if stack.strip() else failure.message


def _describe(index: int, failure: ProcessFailure, shown: bool = False) -> str:
    signal_part = f" ({failure.signal_name()})" if failure.exitcode < 0 else ""
    stack = _callstack(failure.error_file_data)
    # An uncaught exception (exit code 1, its traceback in the error file) was printed by
    # the worker's Python: shown on the console already, it is not shown again.
    if shown and failure.exitcode == 1 and stack.strip() and not failure.stalled:
        lines = [line for line in failure.message.splitlines() if line.strip()]
        last = printable(lines[-1].strip())[:SHOWN_WIDTH] if lines else ""
        message = f"{last} (the traceback is above, in the worker's output)"
    else:
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
