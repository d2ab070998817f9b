"""The guardian: ends an agent's workers at once when the agent dies without stopping them.

How it works: the first worker (or warm standby) an agent process starts also starts this
helper as a script, ``python -I -S .../aelastic/agent/_guard.py``, in a session of its own
(a signal to the agent's terminal or process group does not reach it). Its stdin is a pipe
whose only writer is the agent process. The agent announces every worker process group it
starts (``+ <pgid> <start time>``) and withdraws it once the group is stopped and swept
(``- <pgid>``). The pipe ends when the agent process is gone, however it died (SIGKILL, a
crash, a signal it does not handle) or when it exits normally. The guardian then SIGKILLs
every group still announced and waits for each to empty. A group whose leader's pid now
belongs to a process started at another time (the pid was reused) is left alone.

Why SIGKILL and no grace: an agent stops its workers itself (SIGTERM, the grace, SIGKILL)
whenever it can, a signal it was sent included; a group still announced when it is gone
belongs to a node that nobody runs any more. Its peers drop the node and go on without it,
so its workers have nothing left to do, and a worker that traps SIGTERM (PyTorch Lightning
does: its handler even runs a collective) would go on training with the peers' workers,
holding their collectives, until the grace ended. Killed at once, its sockets close and
the peers' collectives break at once: the quickest sign of the loss they can get.

This complements the kernel's parent-death signal (see :mod:`aelastic.agent.processes.process`),
which reaches only a worker itself, not the processes it started in its group. It imports only the
standard library, never the ``aelastic`` package, so it starts in milliseconds and does not depend
on the agent's environment. :mod:`~aelastic.agent.processes.process` and
:mod:`~aelastic.agent.processes.orphans` import :func:`group_members` and :func:`start_time` from
here.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterable

__all__ = ["group_members", "main", "start_time"]

#: Seconds between two looks at the groups while they empty.
_POLL = 0.05
#: Longest wait for SIGKILLed groups to empty (a process in uninterruptible sleep).
_EMPTY_WITHIN = 5.0


def _stat(pid: int) -> list[bytes] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name, or ``None``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_time(pid: int) -> int:
    """When ``pid`` started, in clock ticks since boot (0 when unknown)."""
    fields = _stat(pid)
    return int(fields[19]) if fields is not None and len(fields) > 19 else 0


def group_members(pgid: int) -> list[int]:
    """Live processes (zombies excluded) of process group ``pgid`` (Linux ``/proc``)."""
    members: list[int] = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return members
    for name in entries:
        if not name.isdigit():
            continue
        fields = _stat(int(name))
        if fields is not None and int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            members.append(int(name))
    return members


def _still_ours(pgid: int, started: int) -> bool:
    """Whether group ``pgid`` can only hold the agent's processes.

    The leader's pid cannot be reused while the group has members; a process with that pid
    but another start time means the group ended and the number went to someone else.
    """
    if not started:
        return True
    current = start_time(pgid)
    return current in (0, started)


def _signal(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _stop(groups: dict[int, int]) -> None:
    """SIGKILL every group still ours until it is empty (a little while at most: a
    process in uninterruptible sleep outlives SIGKILL)."""
    ours = [pgid for pgid, started in groups.items() if _still_ours(pgid, started)]
    deadline = time.monotonic() + _EMPTY_WITHIN
    while ours:
        for pgid in ours:
            _signal(pgid, signal.SIGKILL)
        if time.monotonic() >= deadline:
            return
        time.sleep(_POLL)
        ours = [p for p in ours if group_members(p) and _still_ours(p, groups[p])]


def _read_announcements(stream: Iterable[bytes]) -> dict[int, int]:
    """Read the agent's announcements until end-of-file; the groups still announced, with
    their leaders' start times."""
    groups: dict[int, int] = {}
    for raw in stream:
        parts = raw.split()
        try:
            if len(parts) == 3 and parts[0] == b"+":
                groups[int(parts[1])] = int(parts[2])
            elif len(parts) == 2 and parts[0] == b"-":
                groups.pop(int(parts[1]), None)
        except ValueError:
            continue
    return groups


def main() -> int:
    """Run the guardian on stdin (see the module docstring); the exit status."""
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)
    _stop(_read_announcements(sys.stdin.buffer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
