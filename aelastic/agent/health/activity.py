"""A worker seen from outside: whether its processes work, read from ``/proc``.

How it works: a worker past the first half of its bound without a step
(:mod:`aelastic.agent.health.hang_rule`) is looked at from outside, at no cost to it: :func:`sample`
reads its process and every descendant (data loader workers, a shell wrapper's Python) from
``/proc``: the CPU time they used, the bytes they read and wrote (any file, pipe or socket:
``rchar`` and ``wchar``), and whether a main thread waits for the disk (state ``D``). :func:`busy`
compares two samples: a worker whose processes used at least :data:`CPU_SHARE` of a core, or moved
:data:`IO_RATE` bytes a second, or waited for the disk at the second look, is alive (an evaluation,
a checkpoint written, a data loader's workers preparing the next epoch). A hung worker is idle:
measured here, a worker blocked in gloo's ``all_reduce`` and one in ``time.sleep`` each used 10 ms
of CPU in 5 s (0.2% of a core: a background thread's ticks) and moved no byte; one waiting in
``init_process_group`` for a peer that never comes (its store polls) used 1% of a core and moved 4.4
KB a second; an evaluation uses a whole core, a checkpoint moves megabytes a second. A process seen
running (state ``R``) at one look says nothing: a waiting one wakes now and then. A look costs the
agent 50 to 150 microseconds a process (``benchmarks/hook_cost.py``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["CPU_SHARE", "IO_RATE", "MAX_PROCESSES", "Activity", "busy", "sample"]

#: Share of one core that makes a worker busy (a hung one uses 0.2 to 1%).
CPU_SHARE = 0.05
#: Bytes read or written a second that make a worker busy (a hung one's store polls move
#: 4.4 KB a second; log lines less).
IO_RATE = 32 * 1024
#: Most processes of a worker's tree read.
MAX_PROCESSES = 256
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class Activity:
    """A worker's processes at one moment.

    Attributes:
        cpu: Seconds of CPU they used so far (user and system).
        io: Bytes they read and wrote so far (``rchar + wchar``).
        disk: A main thread of theirs waits for the disk (state ``D``).
        processes: How many were read (0: the worker is gone).
    """

    cpu: float
    io: int
    disk: bool
    processes: int


def busy(before: Activity, after: Activity, seconds: float) -> bool:
    """Whether the worker worked between two samples ``seconds`` apart."""
    if after.disk:
        return True
    seconds = max(seconds, 1.0)
    return (
        after.cpu - before.cpu >= CPU_SHARE * seconds or after.io - before.io >= IO_RATE * seconds
    )


def sample(pid: int) -> Activity:
    """The processes of ``pid`` (the worker's process) and its descendants now; blocking
    (a few small reads of ``/proc``: run it off the event loop)."""
    cpu, io, disk, seen = 0.0, 0, False, 0
    children = _children if _HAS_CHILDREN else _children_by_parent()
    todo = [pid]
    visited: set[int] = set()
    while todo and seen < MAX_PROCESSES:
        proc = todo.pop()
        if proc in visited:
            continue
        visited.add(proc)
        stat = _stat(proc)
        if stat is None:
            continue
        seen += 1
        state, ticks = stat
        cpu += ticks / _TICK
        disk = disk or state == "D"
        io += _io(proc)
        todo.extend(children(proc))
    return Activity(cpu, io, disk, seen)


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, utime + stime in ticks) of ``pid``, or ``None`` when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return fields[0].decode(), int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return None


def _io(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/io", "rb") as f:
            counts = dict(line.split(b": ", 1) for line in f.read().splitlines() if b": " in line)
        return int(counts.get(b"rchar", 0)) + int(counts.get(b"wchar", 0))
    except (OSError, ValueError):
        return 0  # another user's process (a setuid helper): its CPU still counts


#: The kernel lists each task's children (``CONFIG_PROC_CHILDREN``); else the parents are
#: read from every process's ``stat``.
_HAS_CHILDREN = os.path.exists(f"/proc/self/task/{os.getpid()}/children")


def _children_by_parent() -> Callable[[int], list[int]]:
    """A children lookup made from every process's parent (one pass over ``/proc``)."""
    by_parent: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                parent = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        by_parent.setdefault(parent, []).append(int(name))
    return lambda pid: by_parent.get(pid, [])


def _children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children", "rb") as f:
                found.extend(int(c) for c in f.read().split())
        except (OSError, ValueError):
            continue
    return found
