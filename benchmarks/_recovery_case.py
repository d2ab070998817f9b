"""One measured job of ``rdzv_recovery.py``: form N nodes, lose one, time the new round.

How it works: :func:`measure` starts the node processes (``benchmarks/_recovery_node.py``:
``counts[i]`` nodes in process ``i``, the last process holding the one victim node), reads
the JSON lines they print into a :class:`RecoveryJob`, and drives the phases, reading the
server's counters (``_scale_servers``) at each boundary:

1. formation: every node joins at the same wall-clock time; the phase ends when every node
   is in one round of all N (a round formed without a late node is followed by the next:
   the others see it waiting and re-rendezvous, as agents do);
2. wiring: each node's stand-in worker connects to the next rank's (and, with
   ``breaks="all"``, to the victim's); then ``settle`` seconds;
3. idle: ``idle`` seconds of heartbeats only (their rate per node, to set beside the
   recovery's cost; a job whose round changed meanwhile is "unstable", not measured);
4. the loss: SIGKILL of the victim's process (``how="kill"``: its sockets close) or SIGSTOP
   (``how="stop"``, a host that died: nothing closes, only its silence tells); the phase
   ends when every survivor's ``next_rendezvous()`` returned a round after the old one in
   which all survivors are members. Measured: seconds from the signal to each survivor's
   new round (and to each survivor's reaction); the new round checked (one round, world
   N-1, every rank once, every survivor told the same master: rank 0's address and port);
   the server's requests, bytes and CPU from the signal to the last survivor's new round,
   per survivor (beside the idle rate of the same job).
"""

from __future__ import annotations

import os
import signal
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks._scale_case import Job, Worker
from benchmarks._scale_servers import Counters, ServerUnderTest

__all__ = ["RecoveryJob", "measure"]

_STARTUP_TIMEOUT = 300.0
_WIRE_TIMEOUT = 120.0

Key = tuple[int, int]


class RecoveryJob(Job):
    """The node processes of one job, and what their nodes reported."""

    def __init__(self, log_dir: Path, name: str) -> None:
        super().__init__(log_dir, name)
        #: Every node's rounds, in order (``formed`` events).
        self.rounds: dict[Key, list[dict[str, Any]]] = {}
        self.reactions: dict[Key, list[dict[str, Any]]] = {}
        self.broke: dict[Key, list[dict[str, Any]]] = {}
        self.wired: set[Key] = set()

    def _feed(self, worker: Worker, event: dict[str, Any]) -> None:
        kind = event["ev"]
        key = (worker.index, event.get("i", -1))
        if kind == "formed":
            self.rounds.setdefault(key, []).append(event)
        elif kind == "reacting":
            self.reactions.setdefault(key, []).append(event)
        elif kind == "broke":
            self.broke.setdefault(key, []).append(event)
        elif kind == "wired":
            self.wired.add(key)
        else:
            super()._feed(worker, event)

    def latest(self, key: Key) -> dict[str, Any] | None:
        rounds = self.rounds.get(key)
        return rounds[-1] if rounds else None

    def settled_round(self, keys: list[Key], after: float = 0.0) -> int | None:
        """The round every node of ``keys`` is in (its latest, returned after ``after``), if
        it is one round of exactly them and none of them has reacted to a change since."""
        rounds = set()
        for key in keys:
            event = self.latest(key)
            if event is None or event["t"] < after or event["world"] != len(keys):
                return None
            reactions = self.reactions.get(key, [])
            if reactions and reactions[-1]["t"] >= event["t"]:
                return None  # leaving it already
            rounds.add(event["round"])
        return rounds.pop() if len(rounds) == 1 else None


def _new_round(job: RecoveryJob, survivors: list[Key], round_: int) -> dict[str, Any]:
    """The survivors' new round checked: one round, every rank once, one master (rank 0's)."""
    events = [job.latest(key) for key in survivors]
    assert all(e is not None for e in events)
    ranks = sorted(e["rank"] for e in events if e is not None)
    masters = {tuple(e["master"]) for e in events if e is not None}
    zero = [e for e in events if e is not None and e["rank"] == 0]
    expected = (zero[0]["addr"], zero[0]["port"]) if zero else None
    return {
        "round": round_,
        "world": len(events),
        "ranks_ok": ranks == list(range(len(survivors))),
        "master_ok": masters == {expected},
        "master": list(expected) if expected else None,
    }


def _timeline(job: RecoveryJob, since: float) -> list[str]:
    """What happened after ``since``, in order: rounds formed (how many nodes, world, when)
    and reactions (round left, reason, how many, when)."""
    steps: dict[tuple[str, Any, Any], list[float]] = {}
    for events, what in ((job.rounds, "formed"), (job.reactions, "left")):
        for key_events in events.values():
            for e in key_events:
                if e["t"] >= since:
                    detail = e.get("world") if what == "formed" else e.get("reason")
                    steps.setdefault((what, e.get("round"), detail), []).append(e["t"] - since)
    lines = [
        f"{min(ts):.3f}-{max(ts):.3f} s: {len(ts)} {what} round {round_} ({detail})"
        for (what, round_, detail), ts in steps.items()
    ]
    return sorted(lines, key=lambda line: float(line.split("-", 1)[0]))


def _seconds(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"max_s": None, "median_s": None, "min_s": None}
    return {"max_s": max(values), "median_s": statistics.median(values), "min_s": min(values)}


def _cost(spent: Counters, survivors: int) -> dict[str, Any]:
    """The server's work from the loss to the last survivor's new round, per survivor (the
    survivors' heartbeats meanwhile included: the idle rate is ``result["idle"]``)."""
    return {
        "server_cpu_s": spent.cpu,
        "requests_per_survivor": None if spent.commands < 0 else spent.commands / survivors,
        "bytes_per_survivor": spent.bytes_out / survivors,
        "server_cpu_ms_per_survivor": spent.cpu * 1000 / survivors,
    }


async def _form(job: RecoveryJob, n: int, timeout: float) -> tuple[int | None, float, float]:
    at = time.time() + 1.0
    await job.send({"cmd": "form", "at": at})
    everyone: list[Key] = []

    def formed() -> bool:
        everyone[:] = [(w.index, i) for w in job.workers for i in range(w.count)]
        return job.settled_round(everyone) is not None or bool(job.died or job.failed)

    await job.until(formed, timeout + 1.0)
    round_ = job.settled_round(everyone)
    seconds = max(e["t"] for e in map(job.latest, everyone) if e is not None) - at
    return round_, seconds, at


async def measure(
    server: ServerUnderTest,
    counts: list[int],
    command: Callable[[int, int], list[str]],
    *,
    how: str,
    log_dir: Path,
    name: str,
    breaks: str,
    timeout: float,
    settle: float,
    idle: float,
    recovery_timeout: float,
) -> dict[str, Any]:
    """Run one job of ``sum(counts)`` nodes, the last process's one node the victim.

    Returns:
        ``status`` ("ok", "did not start", "did not form", "failed", "unstable": the
        job's round changed before the loss, "did not recover")
        and the measures of each phase that ran.
    """
    job = RecoveryJob(log_dir, name)
    n = sum(counts)
    result: dict[str, Any] = {"n": n, "processes": len(counts), "how": how, "status": "ok"}
    result["breaks"] = breaks
    result["load_average_before"] = os.getloadavg()
    victim: Worker | None = None
    try:
        await job.spawn(counts, command)
        if not await job.until(
            lambda: len(job.ready) == len(counts) or bool(job.died), _STARTUP_TIMEOUT
        ):
            result["status"] = "did not start"
            return result
        round_, seconds, at = await _form(job, n, timeout)
        result["formation"] = {"seconds": seconds, "round": round_}
        result["formation"]["timeline"] = _timeline(job, at)
        if round_ is None:
            result["status"] = "did not form"
            result["errors"] = sorted({e["error"] for e in job.failed.values()})[:5]
            return result
        victim = job.workers[-1]
        assert victim.count == 1
        by_rank = {e["rank"]: e for e in map(job.latest, job.rounds) if e is not None}
        ports = [by_rank[rank]["port"] for rank in range(n)]
        victim_event = job.latest((victim.index, 0))
        assert victim_event is not None
        result["victim_rank"] = victim_event["rank"]
        wire = {"cmd": "wire", "round": round_, "ports": ports, "victim": None}
        if breaks == "all":
            wire["victim"] = victim_event["port"]
        await job.send(wire)
        if not await job.until(lambda: len(job.wired) >= n or bool(job.failed), _WIRE_TIMEOUT):
            result["status"] = "failed"
            result["errors"] = ["the stand-in workers did not connect"]
            return result
        await _sleep(job, settle)
        before_idle, t0 = server.snapshot(), time.time()
        await _sleep(job, idle)
        at_kill = server.snapshot()
        window = time.time() - t0
        spent_idle = at_kill - before_idle
        baseline = {
            "requests": (spent_idle.commands / n / window) if spent_idle.commands >= 0 else None,
            "bytes": spent_idle.bytes_out / n / window,
            "cpu_ms": spent_idle.cpu * 1000 / n / window,
        }
        result["idle"] = {"seconds": window, "per_node_per_s": baseline}
        everyone = list(job.rounds)
        unsettled = [e for r in job.reactions.values() for e in r if e["round"] >= round_]
        if unsettled or job.settled_round(everyone) != round_:
            # A member dropped meanwhile (its beats late on a loaded machine): no measure.
            result["status"] = "unstable"
            result["formation"]["timeline"] = _timeline(job, at)
            return result
        survivors = [key for key in everyone if key[0] != victim.index]
        load = os.getloadavg()
        victim.killed = True  # (its CPU is not the survivors')
        nodes_cpu = job.cpu()
        signalled = time.time()
        os.kill(victim.process.pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        recovered = await job.until(
            lambda: (
                job.settled_round(survivors, after=signalled) is not None
                or bool(job.failed)
                or bool(job.died)
            ),
            recovery_timeout,
        )
        spent = server.snapshot() - at_kill
        nodes_cpu = job.cpu() - nodes_cpu
        result["load_average_at_loss"] = load
        new_round = job.settled_round(survivors, after=signalled)
        if not recovered or new_round is None:
            result["status"] = "did not recover" if not job.failed else "failed"
            result["errors"] = sorted({e["error"] for e in job.failed.values()})[:5]
            late = [k for k in survivors if (job.latest(k) or {"t": 0})["t"] < signalled]
            result["survivors_without_a_new_round"] = len(late)
            return result
        formed_at = [e["t"] - signalled for e in map(job.latest, survivors) if e is not None]
        reacted = [job.reactions[k][-1] for k in survivors if job.reactions.get(k)]
        broke = [job.broke[k][-1]["t"] - signalled for k in survivors if job.broke.get(k)]
        vias: dict[str, int] = {}
        for event in reacted:
            vias[event["via"]] = vias.get(event["via"], 0) + 1
        result["recovery"] = {
            "survivors": len(survivors),
            **_seconds(formed_at),
            "reaction": _seconds([e["t"] - signalled for e in reacted]),
            "collective_broke": {"count": len(broke), **_seconds(broke)},
            "reacted_via": vias,
            "timeline": _timeline(job, signalled),
            "rounds_taken": new_round - round_,
            **_new_round(job, survivors, new_round),
            **_cost(spent, len(survivors)),
            "nodes_cpu_s": nodes_cpu,
        }
        return result
    finally:
        result["load_average_after"] = os.getloadavg()
        if victim is not None and victim.process.returncode is None:
            os.kill(victim.process.pid, signal.SIGKILL)  # a stopped victim reads no "exit"
        await job.stop()
        result["log_issues"] = job.log_issues()


async def _sleep(job: RecoveryJob, seconds: float) -> None:
    """``seconds`` of nothing (but the job's output read meanwhile)."""
    await job.until(lambda: False, seconds)
