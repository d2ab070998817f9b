"""Random faults on a chaos cluster, and the time the live agents take to re-form.

A fault is one of: SIGKILL an agent (its workers are then the guardian's and the kernel's to
stop), SIGSTOP an agent for a while then SIGCONT it (longer than the heartbeat window at
times: the others drop it, and it must notice and join again), SIGSTOP an agent then SIGKILL
it (silent first, as a machine that hangs then dies), SIGTERM an agent (it leaves),
SIGKILL a worker (its agent restarts the group), two kills at once (two agents, an agent and
another agent's worker, or two workers), or a new agent. The choice keeps between 2 and
``max_nodes`` agents (a node past ``max_nodes`` would wait as a spare, never in the round).
Everything random comes from one seeded generator, so a seed replays the same choices (not
the same timings).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from tests.cli._proc import alive

from ._cluster import Agent, Cluster

__all__ = ["KINDS", "Chaos", "Fault", "Reform", "wait_formed"]

KINDS = (
    "kill_agent",
    "stop_agent",
    "stop_kill_agent",
    "term_agent",
    "kill_worker",
    "double_kill",
    "add_agent",
)
_WEIGHTS = {
    "kill_agent": 3,
    "stop_agent": 2,
    "stop_kill_agent": 1,
    "term_agent": 1,
    "kill_worker": 3,
    "double_kill": 1.5,
    "add_agent": 3,
}
#: Longest SIGSTOP, in heartbeat windows.
STOP_WINDOWS = 2.0
#: Longest wait for an added agent's first event (its interpreter's start, under load).
_START_TIMEOUT = 60.0


@dataclass
class Fault:
    kind: str
    detail: str
    #: When the fault was over (monotonic): the SIGCONT of a stop, the join of a new agent.
    at: float


@dataclass(frozen=True)
class Reform:
    """Seconds from a fault until the live agents were in one complete round."""

    #: In the backend's state.
    state: float | None
    #: With every live agent's workers of that round running.
    workers: float | None


class Chaos:
    """Injects random faults into ``cluster`` (see the module docstring)."""

    def __init__(self, cluster: Cluster, rng: random.Random) -> None:
        self.cluster = cluster
        self.rng = rng

    def choose(self) -> str:
        running = len(self.cluster.running())
        live = len(self.cluster.live())
        can_add = running < self.cluster.config.max_nodes
        if live < 3 and can_add:
            return "add_agent"
        weights = dict(_WEIGHTS)
        if not can_add:
            del weights["add_agent"]
        if live < 3:
            for kind in ("kill_agent", "stop_agent", "stop_kill_agent", "term_agent"):
                del weights[kind]
        if live < 4:
            del weights["double_kill"]
        kinds = sorted(weights)
        return self.rng.choices(kinds, [weights[k] for k in kinds])[0]

    def inject(self, kind: str | None = None) -> Fault:
        """Inject one fault (``kind``, or a random one); returns once it is over."""
        kind = kind or self.choose()
        if kind in ("kill_worker", "double_kill") and not self._workers():
            # Every worker is being restarted: kill an agent instead (or add one).
            kind = "kill_agent" if len(self.cluster.live()) >= 3 else "add_agent"
        if kind == "kill_agent":
            return self._done(kind, self._kill_agent())
        if kind == "stop_agent":
            agent = self._pick()
            pause = self.rng.uniform(0.2, STOP_WINDOWS * self.cluster.config.window)
            agent.signal(signal.SIGSTOP)
            time.sleep(pause)
            agent.signal(signal.SIGCONT)
            return self._done(kind, f"{agent} stopped for {pause:.2f} s")
        if kind == "stop_kill_agent":
            agent = self._pick()
            pause = self.rng.uniform(0.1, STOP_WINDOWS * self.cluster.config.window)
            agent.signal(signal.SIGSTOP)
            time.sleep(pause)
            _kill(agent, signal.SIGKILL)
            return self._done(kind, f"{agent} stopped for {pause:.2f} s, then killed")
        if kind == "term_agent":
            agent = self._pick()
            _kill(agent, signal.SIGTERM)
            return self._done(kind, f"{agent} terminated")
        if kind == "kill_worker":
            return self._done(kind, self._kill_worker())
        if kind == "double_kill":
            how = self.rng.choice(["agents", "agent+worker", "workers"])
            if how == "agents":
                first, second = self._kill_agent(), self._kill_agent()
            elif how == "agent+worker":
                first, second = self._kill_worker(), self._kill_agent()
            else:
                first, second = self._kill_worker(), self._kill_worker()
            return self._done(kind, f"{first} and {second}")
        agent = self.cluster.start_agent()
        deadline = time.monotonic() + _START_TIMEOUT
        while not agent.read_events() and agent.running() and time.monotonic() < deadline:
            time.sleep(0.02)
        return self._done(kind, f"{agent} added")

    def _done(self, kind: str, detail: str) -> Fault:
        return Fault(kind, detail, time.monotonic())

    def _pick(self, exclude: tuple[Agent, ...] = ()) -> Agent:
        return self.rng.choice([a for a in self.cluster.live() if a not in exclude])

    def _kill_agent(self) -> str:
        agent = self._pick()
        _kill(agent, signal.SIGKILL)
        return f"{agent} killed"

    def _workers(self) -> list[tuple[Agent, int]]:
        """The live agents' live workers (by pid)."""
        found = [(a, w) for a in self.cluster.live() for w in self.cluster.live_workers(a)]
        return sorted(found, key=lambda item: item[1])

    def _kill_worker(self) -> str:
        candidates = self._workers()
        if not candidates:
            return "no worker to kill"
        agent, pid = self.rng.choice(candidates)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        _wait_until(lambda: not alive(pid))
        return f"worker {pid} of {agent} killed"


def _kill(agent: Agent, sig: signal.Signals) -> None:
    """Send ``sig`` to ``agent``; once it is SIGKILL, return once the agent is dead."""
    agent.signal(sig)
    if sig is signal.SIGKILL:
        _wait_until(lambda: not alive(agent.pid))


def _wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)


def wait_formed(cluster: Cluster, since: float, timeout: float) -> Reform:
    """Wait (until ``since + timeout``) for the live agents to be in one complete round."""
    state: float | None = None
    while time.monotonic() < since + timeout:
        formed = cluster.formed()
        now = time.monotonic() - since
        if formed.state is not None and state is None:
            state = now
        if formed.workers is not None:
            return Reform(state if state is not None else now, now)
        if formed.state is None:
            state = None  # it formed, then changed again: only the final one counts
        time.sleep(0.05)
    return Reform(state, None)
