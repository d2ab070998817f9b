"""A chaos cluster: real ``aelastic run`` agents on one rendezvous, and what they did.

Every agent is ``python -m aelastic run --nnodes 1:MAX`` (one worker, :mod:`._worker`) with
its output in a file and its events in a JSON-lines event log. Every process an agent starts
(worker, warm standby, guardian) inherits the variable ``AELASTIC_CHAOS_MARK=<run id>``, so
whatever is left of a run can be found in ``/proc`` after its agents are gone.

While the cluster runs a sampler thread reads the rendezvous state from the backend (the
same snapshot ``aelastic status`` prints) every ``SAMPLE_PERIOD`` seconds and records a
violation when a complete round's ranks are not ``0..n-1`` without duplicates, or when a
forming round already shows ranks. After the run, :meth:`Cluster.history_violations` checks
every round any agent completed: group ranks distinct and below the round's size, and the
ranks the workers of that round saw (their ``RANK``) distinct too.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from aelastic import sync
from aelastic.backends.registry import create_backend
from aelastic.core.params import RendezvousParameters
from aelastic.core.protocol import RendezvousBackend
from aelastic.core.state import Snapshot
from tests.cli._proc import alive, cli_env, signals_as

__all__ = ["Agent", "ChaosConfig", "Cluster", "Formed"]

WORKER = str(Path(__file__).with_name("_worker.py"))
#: Seconds between two samples of the rendezvous state.
SAMPLE_PERIOD = 0.1
MARK = "AELASTIC_CHAOS_MARK"


@dataclass(frozen=True)
class ChaosConfig:
    """One chaos run's rendezvous and agents (times in seconds)."""

    backend: str
    endpoint: str
    run_id: str
    agents: int = 5
    max_nodes: int = 7
    keep_alive_interval: float = 0.5
    keep_alive_max_attempt: int = 3
    last_call_timeout: float = 1.0
    heartbeat_timeout: float = 1.0
    #: The agents' --shutdown-timeout (and so the guardian's grace).
    grace: int = 2

    @property
    def window(self) -> float:
        """The heartbeat window: silence after which a node is presumed dead."""
        return self.keep_alive_interval * self.keep_alive_max_attempt

    @property
    def reform_bound(self) -> float:
        """How long after a fault the live nodes may take to be in one complete round."""
        return self.window + self.last_call_timeout + 2.0

    def rdzv_conf(self) -> str:
        return (
            f"keep_alive_interval={self.keep_alive_interval},"
            f"keep_alive_max_attempt={self.keep_alive_max_attempt},"
            f"last_call_timeout={self.last_call_timeout},"
            f"heartbeat_timeout={self.heartbeat_timeout},join_timeout=600"
        )


class Agent:
    """One ``aelastic run`` process of the cluster."""

    def __init__(self, index: int, proc: subprocess.Popen[bytes], events: Path, log: Path):
        self.index = index
        self.proc = proc
        self.pid = proc.pid
        self.events_path = events
        self.log_path = log
        self.stopped = False  # SIGSTOPped now
        self.killed = False  # SIGKILLed or SIGTERMed by the cluster
        self.events: list[dict[str, Any]] = []
        self._offset = 0
        self._partial = b""

    def __repr__(self) -> str:
        return f"agent#{self.index}(pid {self.pid})"

    def running(self) -> bool:
        return self.proc.poll() is None

    def live(self) -> bool:
        """Running, neither stopped nor killed: it should be in the round."""
        return not (self.stopped or self.killed) and self.running()

    def signal(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            self.killed = True
        elif sig is signal.SIGSTOP:
            self.stopped = True
        elif sig is signal.SIGCONT:
            self.stopped = False

    def read_events(self) -> list[dict[str, Any]]:
        """The events logged so far (read incrementally)."""
        try:
            with open(self.events_path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return self.events
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        self.events.extend(json.loads(line) for line in lines if line.strip())
        return self.events

    def latest(self, kind: str) -> dict[str, Any] | None:
        """The newest event of ``kind`` read so far."""
        for event in reversed(self.events):
            if event["kind"] == kind:
                return event
        return None

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


@dataclass(frozen=True)
class Formed:
    """Whether the live agents are in one complete round (``None``: not yet)."""

    #: The backend's state shows exactly the live agents in a complete round.
    state: int | None
    #: Moreover every live agent has its workers of that round running.
    workers: int | None


class Cluster:
    """Agents on one rendezvous, their workers and the samples (see the module docstring)."""

    def __init__(self, config: ChaosConfig, directory: Path) -> None:
        self.config = config
        self.dir = directory
        self.worker_dir = directory / "workers"
        self.worker_dir.mkdir(parents=True, exist_ok=True)
        self.agents: list[Agent] = []
        self.violations: list[str] = []
        self.samples = 0
        self._workers: dict[int, dict[str, Any]] = {}
        self._logs: list[IO[bytes]] = []
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None
        params = RendezvousParameters(
            config.backend, config.endpoint, config.run_id, 1, config.max_nodes, read_timeout=10
        )

        async def make() -> RendezvousBackend:
            return create_backend(params)

        self._backend = sync.run(make())

    # -- agents -----------------------------------------------------------------------------

    def start_agent(self) -> Agent:
        c = self.config
        index = len(self.agents)
        events = self.dir / f"agent-{index}.events.jsonl"
        log = open(self.dir / f"agent-{index}.log", "wb")  # noqa: SIM115 (closed in close())
        self._logs.append(log)
        argv = [sys.executable, "-m", "aelastic", "run", f"--nnodes=1:{c.max_nodes}"]
        argv += [f"--rdzv-backend={c.backend}", f"--rdzv-endpoint={c.endpoint}"]
        argv += [f"--rdzv-id={c.run_id}", f"--rdzv-conf={c.rdzv_conf()}"]
        argv += ["--local-addr=127.0.0.1", "--max-restarts=1000000"]
        argv += [f"--shutdown-timeout={c.grace}", f"--event-log={events}"]
        argv += [WORKER, str(self.worker_dir)]
        proc = subprocess.Popen(
            argv,
            cwd=self.dir,
            env=cli_env({MARK: c.run_id}),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=signals_as(),  # the stop signals at their default, whatever ours are
        )
        agent = Agent(index, proc, events, Path(log.name))
        self.agents.append(agent)
        return agent

    def live(self) -> list[Agent]:
        return [a for a in self.agents if a.live()]

    def running(self) -> list[Agent]:
        """Agents not killed by the cluster and not ended (stopped ones too)."""
        return [a for a in self.agents if not a.killed and a.running()]

    def workers(self) -> dict[int, dict[str, Any]]:
        """Every worker that started so far, by pid (its record, see :mod:`._worker`)."""
        for path in self.worker_dir.glob("*.json"):
            pid = int(path.stem)
            if pid not in self._workers:
                with contextlib.suppress(OSError, ValueError):
                    self._workers[pid] = json.loads(path.read_text())
        return self._workers

    def live_workers(self, agent: Agent) -> list[int]:
        return [p for p, w in self.workers().items() if w["agent"] == agent.pid and alive(p)]

    # -- the rendezvous ---------------------------------------------------------------------

    def snapshot(self) -> Snapshot | None:
        return sync.run(self._backend.snapshot(), 30)

    def formed(self) -> Formed:
        """Whether every live agent, and only those, is in one complete round now."""
        snap = self.snapshot()
        if snap is None or not snap.status.complete or snap.status.closed:
            return Formed(None, None)
        if snap.status.lost or snap.status.finished:
            return Formed(None, None)  # what is left of a round: a new one comes
        ranks = {e.node.pid: e.rank for e in snap.participants}
        live = {a.pid: a for a in self.live()}
        if set(ranks) != set(live) or snap.wait_list or snap.redundancy_list:
            return Formed(None, None)
        current = snap.status.round
        for pid, agent in live.items():
            agent.read_events()
            completed = agent.latest("rendezvous")
            started = agent.latest("workers_started")
            if completed is None or completed["round"] != current:
                return Formed(current, None)
            if completed["group_rank"] != ranks[pid]:
                self._violation(
                    f"{agent} logged rank {completed['group_rank']} in round {current}, "
                    f"the state says {ranks[pid]}"
                )
            if (
                started is None
                or started["round"] != current
                or not all(alive(p) for p in started["pids"].values())
            ):
                return Formed(current, None)
        return Formed(current, current)

    def start_sampling(self) -> None:
        self._sampler = threading.Thread(target=self._sample, name="chaos-sampler", daemon=True)
        self._sampler.start()

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_PERIOD):
            try:
                snap = self.snapshot()
            except Exception as exc:  # reported, and the sampling goes on
                self._violation(f"the rendezvous state could not be read: {exc!r}")
                continue
            self.samples += 1
            if snap is None:
                continue
            status, ranks = snap.status, [e.rank for e in snap.participants]
            if not status.complete:
                if any(r is not None for r in ranks):
                    self._violation(f"round {status.round}: ranks {ranks} while forming")
            elif None in ranks or len(set(ranks)) != len(ranks):
                self._violation(f"round {status.round}: ranks {ranks} (complete)")
            elif not (status.lost or status.finished) and sorted(ranks) != [*range(len(ranks))]:
                # Members lost or gone since the completion keep no rank; the others keep theirs.
                self._violation(f"round {status.round}: ranks {ranks} (complete, nobody lost)")

    def _violation(self, text: str) -> None:
        if text not in self.violations and len(self.violations) < 50:
            self.violations.append(text)

    # -- the end ----------------------------------------------------------------------------

    def stop_all(self) -> None:
        """Continue stopped agents, SIGTERM the running ones and wait for their exits."""
        self._stop.set()
        if self._sampler is not None:
            self._sampler.join(30)
        for agent in self.agents:
            if agent.stopped:
                agent.signal(signal.SIGCONT)
        for agent in self.running():
            agent.signal(signal.SIGTERM)
        deadline = time.monotonic() + self.config.grace + 30
        for agent in self.agents:
            try:
                agent.proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                self._violation(f"{agent} did not exit on SIGTERM:\n{agent.log_tail()}")
                agent.proc.kill()
                agent.proc.wait()

    def leftovers(self) -> list[int]:
        """Processes started by this run's agents (workers, standbys, guardians) still alive."""
        needle = f"{MARK}={self.config.run_id}".encode()
        found = []
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/environ", "rb") as f:
                    environ = f.read().split(b"\0")
            except OSError:
                continue
            if needle in environ and alive(int(name)):
                found.append(int(name))
        # Every worker that recorded itself, too (whatever its environment shows).
        found += [pid for pid in self.workers() if pid not in found and alive(pid)]
        return found

    def wait_no_leftovers(self, timeout: float) -> list[int]:
        """Wait until nothing of the run is left (at most ``timeout``); what is left."""
        deadline = time.monotonic() + timeout
        while (left := self.leftovers()) and time.monotonic() < deadline:
            time.sleep(0.1)
        return left

    def unexpected_exits(self) -> list[str]:
        """Agents that ended although the cluster neither killed nor stopped them."""
        return [
            f"{a} exited with {a.proc.returncode} by itself:\n{a.log_tail()}"
            for a in self.agents
            if not a.killed and a.proc.poll() is not None
        ]

    def history_violations(self) -> list[str]:
        """Rounds in which two agents, or two workers, had the same rank (see the docstring)."""
        found: list[str] = []
        by_round: dict[int, dict[int, int]] = defaultdict(dict)  # round -> agent pid -> rank
        sizes: dict[int, set[int]] = defaultdict(set)
        worker_round: dict[int, int] = {}
        for agent in self.agents:
            for event in agent.read_events():
                if event["kind"] == "rendezvous":
                    by_round[event["round"]][agent.pid] = event["group_rank"]
                    sizes[event["round"]].add(event["group_world_size"])
                elif event["kind"] == "workers_started":
                    for pid in event["pids"].values():
                        worker_round[pid] = event["round"]
        for rnd, ranks in sorted(by_round.items()):
            values = list(ranks.values())
            size = sizes[rnd]
            if len(set(values)) != len(values) or len(size) != 1 or max(values) >= min(size):
                found.append(f"round {rnd}: group ranks {ranks}, sizes {sorted(size)}")
        seen: dict[int, dict[int, int]] = defaultdict(dict)  # round -> RANK -> worker pid
        for pid, record in self.workers().items():
            rnd_or_none = worker_round.get(pid)
            if rnd_or_none is None:
                continue
            other = seen[rnd_or_none].setdefault(record["rank"], pid)
            if other != pid:
                found.append(
                    f"round {rnd_or_none}: workers {other} and {pid} both RANK {record['rank']}"
                )
        return found

    def close(self) -> None:
        """Kill whatever is left (a failed test) and release the backend."""
        self._stop.set()
        for agent in self.agents:
            if agent.running():
                agent.proc.kill()
                agent.proc.wait()
        for pid in self.leftovers():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for log in self._logs:
            log.close()
        with contextlib.suppress(Exception):
            sync.run(self._backend.aclose(), 10)
