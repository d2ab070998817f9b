"""Worker output: redirect to files, tee to files and the console, per-attempt directories.

How it works: an agent makes one directory of its own under the log root, as torch does
(``tempfile.mkdtemp(prefix=f"{run_id}_")``: ``<root>/<run_id>_<random>/``), and in it, for
every start of the workers, ``attempt_<n>/<local_rank>/`` holding ``stdout.log``,
``stderr.log`` (when redirected or teed) and ``error.json`` (where torch's ``@record``
writes). Nothing that exists is ever removed or reused: a job run again with the same id,
and agents sharing a ``log_dir``, each keep their own. Each stream of each worker gets a
:class:`Target`:

* ``INHERIT``: the agent's own stream (no copy, no cost), as torch does by default;
* ``DEVNULL``: hidden (a local rank outside ``local_ranks_filter``);
* ``FILE``: the file is handed to the worker directly (redirect, or a filtered-out tee);
* ``TEE``: a pipe the agent reads as data arrives, writing each chunk to the file and each
  line, prefixed ``[role0]:``, to the console (queued, never blocking the loop: a console
  that stops reading gets a note of the lines it missed, see :mod:`.writer`). Nothing
  tails a file.

With ``duplicate_stdout_filters`` (or ``_stderr_``), the teed lines that contain any of the
filter strings are also written, prefixed, to ``filtered_stdout.log`` (``filtered_stderr.log``)
in the attempt's directory, one file for all local ranks, as torch's ``PContext`` does: only
teed streams shown on the console are looked at.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from string import Template
from typing import IO, Any

from ..api import Std, WorkerSpec, std_map
from . import writer

__all__ = [
    "AttemptLogs",
    "Target",
    "line_prefix",
    "plan_streams",
    "run_log_dir",
    "stderr_on_console",
]


#: The duplicate files of stdout and stderr (torch's names).
_FILTERED = ("filtered_stdout.log", "filtered_stderr.log")


class Target(enum.Enum):
    """Where one stream of one worker goes."""

    INHERIT = "inherit"
    DEVNULL = "devnull"
    FILE = "file"
    TEE = "tee"


def run_log_dir(spec: WorkerSpec, run_id: str) -> tuple[str | None, str | None]:
    """Create this agent's own ``<log_dir>/<run_id>_<random>`` (torch's ``mkdtemp``); it,
    and the root made for it when ``log_dir`` is ``None``.

    Returns:
        ``(run_dir, made_root)``: ``(None, None)`` for ``os.devnull`` (no files at all).

    Raises:
        NotADirectoryError: ``log_dir`` is a file.
    """
    if spec.log_dir == os.devnull:
        return None, None
    root, made = spec.log_dir, None
    if root is None:
        root = made = tempfile.mkdtemp(prefix="aelastic_")
    elif os.path.isfile(root):
        raise NotADirectoryError(f"log_dir {root} is a file")
    os.makedirs(root, exist_ok=True)
    prefix = run_id.replace(os.sep, "_") + "_"
    return tempfile.mkdtemp(prefix=prefix, dir=root), made


def plan_streams(spec: WorkerSpec, files: bool) -> dict[int, tuple[Target, Target]]:
    """The targets of (stdout, stderr) for every local rank (torch's ``DefaultLogsSpecs``).

    Args:
        spec: Redirects, tee and the console filter.
        files: Whether log files exist (``False`` when ``log_dir`` is ``os.devnull``).
    """
    redirects = std_map(spec.redirects, spec.local_world_size)
    tees = std_map(spec.tee, spec.local_world_size)
    shown = spec.local_ranks_filter
    plans: dict[int, tuple[Target, Target]] = {}
    for rank in range(spec.local_world_size):
        visible = shown is None or not shown or rank in shown
        pair = []
        for std in (Std.OUT, Std.ERR):
            if not files:
                target = Target.INHERIT
            elif tees[rank] & std:
                target = Target.TEE if visible else Target.FILE
            elif redirects[rank] & std:
                target = Target.FILE
            else:
                target = Target.INHERIT if visible else Target.DEVNULL
            pair.append(target)
        plans[rank] = (pair[0], pair[1])
    return plans


def stderr_on_console(spec: WorkerSpec, local_rank: int) -> bool:
    """Whether the stderr of the worker of ``local_rank`` reaches the agent's own stderr
    (not redirected, or teed; and not filtered out)."""
    plan = plan_streams(spec, files=spec.log_dir != os.devnull).get(local_rank)
    return plan is not None and plan[1] in (Target.INHERIT, Target.TEE)


def line_prefix(spec: WorkerSpec, local_rank: int, global_rank: int) -> str:
    """The console prefix of a worker's teed lines (``[role0]:`` unless templated)."""
    if spec.log_line_prefix_template:
        return Template(spec.log_line_prefix_template).safe_substitute(
            role_name=spec.role, rank=global_rank, local_rank=local_rank
        )
    return f"[{spec.role}{local_rank}]:"


class _Duplicate:
    """The attempt's ``filtered_std*.log``: teed lines that contain one of the filters."""

    def __init__(self, path: str, needles: tuple[str, ...]) -> None:
        self._file = open(path, "w", encoding="utf-8", errors="replace")  # noqa: SIM115
        self._needles = needles

    def offer(self, lines: list[str]) -> None:
        kept = [line for line in lines if any(n in line for n in self._needles)]
        if kept:
            with contextlib.suppress(OSError, ValueError):
                self._file.write("".join(kept))
                self._file.flush()

    def close(self) -> None:
        self._file.close()


class _TeeProtocol(asyncio.Protocol):
    """Copies a worker's pipe to its log file and, line by line with a prefix, to a console
    (and the lines that match the filters to the duplicate file)."""

    def __init__(
        self, file: IO[bytes], console: IO[str], prefix: str, duplicate: _Duplicate | None
    ) -> None:
        self._file = file
        self._console = console
        self._prefix = prefix
        self._duplicate = duplicate
        self._partial = b""
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        self._file.write(data)
        self._file.flush()
        chunk = self._partial + data
        *lines, self._partial = chunk.split(b"\n")
        if lines:
            self._show(lines)

    def _show(self, lines: list[bytes]) -> None:
        shown = [f"{self._prefix}{ln.decode(errors='replace')}\n" for ln in lines]
        writer.write(self._console, "".join(shown))
        if self._duplicate is not None:
            self._duplicate.offer(shown)

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self._partial:
            self._show([self._partial])
            self._partial = b""
        with contextlib.suppress(OSError, ValueError):
            self._file.close()
        if not self.done.done():
            self.done.set_result(None)


def _factory(protocol: _TeeProtocol) -> Callable[[], _TeeProtocol]:
    return lambda: protocol


@dataclass
class _Pending:
    read_fd: int
    write_fd: int
    file: IO[bytes]
    console: IO[str]
    duplicate: _Duplicate | None


class AttemptLogs:
    """The log directory and stream plumbing of one attempt.

    Args:
        spec: The worker spec.
        run_dir: The agent's ``<log_dir>/<run_id>_<random>`` (``None``: no files at all).
        attempt: The attempt number.
    """

    def __init__(self, spec: WorkerSpec, run_dir: str | None, attempt: int) -> None:
        self._spec = spec
        self.dir = None if run_dir is None else os.path.join(run_dir, f"attempt_{attempt}")
        self._plans = plan_streams(spec, files=self.dir is not None)
        self._pending: dict[int, list[_Pending]] = {}
        self._opened: list[IO[Any]] = []
        self._tees: list[tuple[asyncio.BaseTransport, _TeeProtocol]] = []
        self._duplicates: list[_Duplicate | None] = [None, None]
        if self.dir is not None:
            os.mkdir(self.dir)  # new in the agent's own directory: nothing is overwritten
            for rank in range(spec.local_world_size):
                os.mkdir(os.path.join(self.dir, str(rank)))
            filters = (spec.duplicate_stdout_filters, spec.duplicate_stderr_filters)
            for index, (needles, name) in enumerate(zip(filters, _FILTERED, strict=True)):
                if needles:
                    path = os.path.join(self.dir, name)
                    self._duplicates[index] = _Duplicate(path, tuple(needles or ()))

    def path(self, local_rank: int, name: str) -> str:
        """Path of ``name`` in the local rank's directory (``os.devnull`` without files)."""
        if self.dir is None:
            return os.devnull
        return os.path.join(self.dir, str(local_rank), name)

    def error_file(self, local_rank: int) -> str:
        """The ``TORCHELASTIC_ERROR_FILE`` of a local rank (``""`` without files, as torch)."""
        return "" if self.dir is None else self.path(local_rank, "error.json")

    def targets(self, local_rank: int) -> tuple[Target, Target]:
        """Where the local rank's (stdout, stderr) go."""
        return self._plans[local_rank]

    def child_streams(self, local_rank: int) -> tuple[int | IO[Any] | None, int | IO[Any] | None]:
        """The ``stdout``/``stderr`` arguments for the worker's ``Popen`` (call once per start)."""
        result: list[int | IO[Any] | None] = []
        pending: list[_Pending] = []
        for target, name, console, duplicate in zip(
            self._plans[local_rank],
            ("stdout.log", "stderr.log"),
            (sys.stdout, sys.stderr),
            self._duplicates,
            strict=True,
        ):
            if target is Target.INHERIT:
                result.append(None)
            elif target is Target.DEVNULL:
                result.append(open(os.devnull, "wb"))  # noqa: SIM115 - closed after spawn
                self._opened.append(result[-1])  # type: ignore[arg-type]
            elif target is Target.FILE:
                result.append(open(self.path(local_rank, name), "ab"))  # noqa: SIM115
                self._opened.append(result[-1])  # type: ignore[arg-type]
            else:
                read_fd, write_fd = os.pipe()
                file = open(self.path(local_rank, name), "ab")  # noqa: SIM115
                pending.append(_Pending(read_fd, write_fd, file, console, duplicate))
                result.append(write_fd)
        self._pending[local_rank] = pending
        return result[0], result[1]

    async def after_spawn(self, local_rank: int, global_rank: int) -> None:
        """Close the parent's copies of the child's ends; start copying teed pipes."""
        self._close_opened()
        prefix = line_prefix(self._spec, local_rank, global_rank)
        loop = asyncio.get_running_loop()
        for item in self._pending.pop(local_rank, []):
            os.close(item.write_fd)
            pipe = os.fdopen(item.read_fd, "rb", buffering=0)
            protocol = _TeeProtocol(item.file, item.console, prefix, item.duplicate)
            transport, _ = await loop.connect_read_pipe(_factory(protocol), pipe)
            self._tees.append((transport, protocol))

    def abandon(self, local_rank: int) -> None:
        """Release what :meth:`child_streams` opened when the spawn failed."""
        self._close_opened()
        for item in self._pending.pop(local_rank, []):
            for fd in (item.read_fd, item.write_fd):
                with contextlib.suppress(OSError):
                    os.close(fd)
            item.file.close()

    def _close_opened(self) -> None:
        for handle in self._opened:
            handle.close()
        self._opened.clear()

    async def aclose(self, timeout: float = 2.0) -> None:
        """Wait (at most ``timeout``) for teed pipes to drain, then close them."""
        for rank in list(self._pending):
            self.abandon(rank)
        waits = [protocol.done for _, protocol in self._tees]
        if waits:
            await asyncio.wait(waits, timeout=timeout)
        for transport, _ in self._tees:
            transport.close()
        if waits:
            # Let the transports deliver connection_lost (closes the log files).
            await asyncio.wait(waits, timeout=timeout)
        self._tees.clear()
        for duplicate in self._duplicates:
            if duplicate is not None:
                duplicate.close()
        self._duplicates = [None, None]
