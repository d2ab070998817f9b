"""Workers that outlive SIGKILL: how long to wait for them, and what ``/proc`` says of them.

How it works: a process in uninterruptible sleep (``D`` state: a dead GPU, an NFS or FUSE
server that stopped answering) does not die on SIGKILL until the kernel call it waits in
returns, which may be never. The agent waits :func:`unkillable_bound` seconds after SIGKILL
(torch 2.13's ``TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT`` when set and positive; else
the stop's grace period, as torch's bounded join, and never less than
:data:`MIN_BOUND`), then describes each survivor (:func:`inspect`: pid, state and the
kernel function it waits in, from ``/proc``) and raises :class:`WorkersUnkillable`: the
agent reports them, leaves the rendezvous so the other nodes go on, answers its health
check unhealthy and exits, instead of waiting forever.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "MIN_BOUND",
    "TIMEOUT_VAR",
    "Unkillable",
    "WorkersUnkillable",
    "inspect",
    "unkillable_bound",
]

#: torch's variable (seconds a worker may stay in uninterruptible sleep).
TIMEOUT_VAR = "TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT"
#: The shortest wait after SIGKILL (seconds): dying may take a moment (freeing memory).
MIN_BOUND = 5.0


def unkillable_bound(grace: float, env: Mapping[str, str] | None = None) -> float:
    """Seconds to wait for a SIGKILLed worker before calling it unkillable."""
    raw = (os.environ if env is None else env).get(TIMEOUT_VAR, "").strip()
    try:
        value = float(raw) if raw else 0.0
    except ValueError:
        value = 0.0
    if value > 0:
        return value
    return max(grace, MIN_BOUND)


@dataclass(frozen=True)
class Unkillable:
    """A process that did not die on SIGKILL.

    Attributes:
        pid: Its pid.
        local_rank: The local rank it served (``-1``: not a worker).
        state: Its state from ``/proc/<pid>/status`` (``"D (disk sleep)"``), or ``"?"``.
        wchan: The kernel function it waits in (``/proc/<pid>/wchan``), or ``"?"``.
    """

    pid: int
    local_rank: int
    state: str
    wchan: str

    def __str__(self) -> str:
        where = f"state {self.state}, waiting in {self.wchan}"
        return f"pid {self.pid} (local rank {self.local_rank}): {where}"


def inspect(pid: int, local_rank: int = -1) -> Unkillable:
    """What ``/proc`` says of ``pid`` now."""
    state = wchan = "?"
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("State:"):
                    state = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        with open(f"/proc/{pid}/wchan", encoding="utf-8", errors="replace") as f:
            wchan = f.read().strip() or "?"
    except OSError:
        pass
    if wchan == "0":
        wchan = "?"
    return Unkillable(pid, local_rank, state, wchan)


_KEPT: list[subprocess.Popen[bytes]] = []


def keep(popen: subprocess.Popen[bytes]) -> None:
    """Hold on to a process given up on, so that it is reaped once it dies
    (:func:`reap_kept`) rather than left to ``Popen``'s "still running" warning."""
    _KEPT.append(popen)


def reap_kept() -> int:
    """Reap the processes given up on that died since; how many are still alive."""
    _KEPT[:] = [p for p in _KEPT if p.poll() is None]
    return len(_KEPT)


class WorkersUnkillable(Exception):
    """Workers survived SIGKILL for longer than the bound: the agent gives up on them.

    Attributes:
        survivors: What ``/proc`` said of each.
        bound: The seconds waited after SIGKILL.
    """

    def __init__(self, survivors: Sequence[Unkillable], bound: float) -> None:
        self.survivors = tuple(survivors)
        self.bound = bound
        listed = "; ".join(str(s) for s in self.survivors)
        super().__init__(
            f"{len(self.survivors)} worker(s) still alive {bound:g} s after SIGKILL ({listed})"
        )
