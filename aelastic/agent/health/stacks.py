"""The Python stacks of a stalled worker: asked for with a signal, read from a file, parsed.

How it works: a worker that reported progress armed ``faulthandler`` on a signal written in
its page (:mod:`aelastic.worker._site._aelastic_worker`). :func:`dump_stacks` sends that
signal and waits until the worker's stacks file stops growing (faulthandler writes from the
signal handler, in C, even while the main thread is blocked in a collective; there is no
end marker, so the file is read once it has been quiet for a moment, at most
:data:`DUMP_WAIT` seconds). :func:`parse_stacks` splits faulthandler's text into threads and
frames; :func:`where` names the innermost frame of the main thread (the stuck line) and the
innermost one in the user's own code; :func:`in_collective` says whether the main thread is
inside ``torch.distributed`` (waiting for a peer rather than stuck by itself).
:func:`stopped` reads the process's state from ``/proc``: a stopped process (``SIGSTOP``, a
debugger) cannot answer, so it is not asked and not waited for.
"""

from __future__ import annotations

import asyncio
import functools
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "DUMP_WAIT",
    "Frame",
    "ThreadStack",
    "dump_stacks",
    "in_collective",
    "main_stack",
    "parse_stacks",
    "stopped",
    "where",
]

#: Longest wait for a dump (seconds; a loaded machine may be slow to run the handler).
DUMP_WAIT = 5.0
#: A dump is complete once its file has not grown for this long (seconds).
_QUIET = 0.15
_STEP = 0.02
#: Most bytes of a dump kept (a job with thousands of threads has long dumps).
MAX_DUMP = 256 * 1024

_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+)")
_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>.*)$')


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    """Python's own directories and site-packages (looked up once: sysconfig is slow)."""
    import sysconfig

    paths = sysconfig.get_paths()
    keys = ("stdlib", "platstdlib", "purelib", "platlib")
    return tuple(os.path.join(os.path.realpath(p), "") for k in keys if (p := paths.get(k)))


@dataclass(frozen=True)
class Frame:
    """One frame of a dump."""

    file: str
    line: int
    func: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} in {self.func}"


@dataclass(frozen=True)
class ThreadStack:
    """One thread of a dump: innermost frame first (faulthandler's order)."""

    ident: int
    current: bool
    frames: tuple[Frame, ...]


def parse_stacks(text: str) -> list[ThreadStack]:
    """The threads of a faulthandler dump (frames innermost first)."""
    threads: list[ThreadStack] = []
    ident: int | None = None
    current = False
    frames: list[Frame] = []
    for line in text.splitlines():
        head = _THREAD.match(line)
        if head is not None:
            if ident is not None:
                threads.append(ThreadStack(ident, current, tuple(frames)))
            ident, current, frames = int(head.group(2), 16), head.group(1) != "Thread", []
            continue
        frame = _FRAME.match(line)
        if frame is not None and ident is not None:
            frames.append(Frame(frame["file"], int(frame["line"]), frame["func"]))
    if ident is not None:
        threads.append(ThreadStack(ident, current, tuple(frames)))
    return threads


def main_stack(threads: Sequence[ThreadStack], main_ident: int) -> ThreadStack | None:
    """The main thread's stack (by its ident; the only thread when there is one)."""
    for thread in threads:
        if thread.ident == main_ident:
            return thread
    return threads[0] if len(threads) == 1 else None


def _is_library(path: str) -> bool:
    return os.path.realpath(path).startswith(_library_dirs()) or path.startswith("<")


def where(stack: ThreadStack | None) -> tuple[str, str]:
    """``(innermost frame, innermost frame of the user's code)`` as ``file:line in func``
    (empty strings when unknown; the second is empty when it is the first)."""
    if stack is None or not stack.frames:
        return "", ""
    top = stack.frames[0]
    mine = next((f for f in stack.frames if not _is_library(f.file)), None)
    return str(top), "" if mine is None or mine == top else str(mine)


def in_collective(stack: ThreadStack | None) -> bool:
    """Whether the thread is inside ``torch.distributed`` (a collective, a barrier, a
    store wait): then it most likely waits for a peer that is stuck or gone."""
    if stack is None:
        return False
    marker = os.path.join("torch", "distributed", "")
    return any(marker in f.file for f in stack.frames)


def stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped (``SIGSTOP``, ``SIGTSTP``, a debugger: state ``T`` or
    ``t`` in ``/proc/<pid>/stat``): it runs no signal handler until it is continued."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return False
    return bool(fields) and fields[0] in (b"T", b"t")


async def dump_stacks(targets: Sequence[tuple[int, int, str]]) -> dict[int, str]:
    """Ask each ``(pid, signal, stacks file)`` for its stacks; what each wrote, by pid.

    A worker that is gone, or whose dump did not come within :data:`DUMP_WAIT`, gives what
    its file holds (maybe nothing); a worker that is :func:`stopped` (now, or while it is
    waited for) is not waited for.
    """
    sizes: dict[int, int] = {}
    for pid, signum, path in targets:
        sizes[pid] = _size(path)
        try:
            os.kill(pid, signum)
        except OSError:
            continue
    deadline = time.monotonic() + DUMP_WAIT
    last = dict(sizes)
    quiet_since = {pid: time.monotonic() for pid in sizes}
    pending = {pid: path for pid, _, path in targets}
    while pending and time.monotonic() < deadline:
        await asyncio.sleep(_STEP)
        now = time.monotonic()
        for pid, path in list(pending.items()):
            if stopped(pid):
                del pending[pid]  # it cannot answer until it is continued
                continue
            size = _size(path)
            if size != last[pid]:
                last[pid], quiet_since[pid] = size, now
            elif size > sizes[pid] and now - quiet_since[pid] >= _QUIET:
                del pending[pid]
    return {pid: _read_from(path, sizes[pid]) for pid, _, path in targets}


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _read_from(path: str, offset: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(MAX_DUMP).decode(errors="replace")
    except OSError:
        return ""
