"""Hang detection: workers alive but making no progress, found, described and stopped.

How it works: :func:`watch_stalls` runs beside the attempt's workers (one more racer of
:func:`~aelastic.agent.loop.supervise.supervise`). It reads the workers' progress pages
(:mod:`aelastic.agent.health.progress`) and sleeps until the earliest moment a worker could have
stalled (:mod:`aelastic.agent.health.hang_rule`: the bound, learned from the steps or a fixed
number, and the start-up bound before the first step). A worker whose rule says so is first looked
at from outside (:mod:`aelastic.agent.health.activity`, at the first half of its bound and at its
end: busy, it is alive); then the agent asks the stalled workers for the Python stacks of every
thread (:mod:`aelastic.agent.health.stacks`) and tells the agent (``report``: the console line, the
event, the stacks in the log directory). A worker waiting inside ``torch.distributed`` under a
learned bound is left to the rank at fault (logged once;
:meth:`~aelastic.agent.health.seen.Seen.leave_to_peers`). Otherwise a node whose stalled workers all
wait inside ``torch.distributed`` is most likely waiting for a peer that is stuck elsewhere: it
waits one more timeout (at least :data:`~aelastic.agent.health.stacks.DUMP_WAIT`, the longest a
peer's agent waits for stacks that do not come; at start-up up to a minute), so that the peer's own
agent acts first and the group change stops these workers without a restart spent here; when the
job's health then names another node's worker the root cause of this round, the peer acted and the
change is on its way: a few more waits (:data:`HOLDS`) before these workers are stopped. A stalled
worker that cannot be asked for stacks (stopped by ``SIGSTOP`` or a debugger, or silent past the
dump's bound) is the suspect: it is stopped at once, and its failure is its own, never one that
broke in a collective, so that it is named the root cause before the peers that wait for it. Then
the stalled workers' process groups get SIGKILL (as torch's file-timer watchdog does): their exit is
a worker failure like any other, described with the stall (:meth:`Stall.describe`) and its stacks.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence

import anyio

from ..processes.process import WorkerProcess
from ..processes.unkillable import WorkersUnkillable, inspect, unkillable_bound
from .hang_rule import HangRule, Watch
from .progress import ProgressPages
from .seen import Seen, Stall
from .stacks import DUMP_WAIT, dump_stacks, in_collective, main_stack, parse_stacks, stopped, where

__all__ = ["Stall", "watch_stalls"]

log = logging.getLogger("aelastic.agent")


async def watch_stalls(
    pages: ProgressPages,
    processes: Sequence[WorkerProcess],
    rule: HangRule,
    report: Callable[[list[Stall], bool], None],
    grace: float,
    elsewhere: Callable[[], Awaitable[bool]] | None = None,
) -> None:
    """Watch ``processes`` until some stall, report them, SIGKILL their groups; then wait
    (the exit of the killed workers ends the attempt). Never returns.

    Args:
        pages: The attempt's progress pages.
        processes: The attempt's workers.
        rule: How hangs are found (:mod:`aelastic.agent.health.hang_rule`).
        report: Called with the stalls and whether the node waits for a peer first.
        grace: The workers' stop grace (bounds the wait for a SIGKILLed worker).
        elsewhere: Whether the job's root cause of this round is another node's (asked
            once the wait for a peer is over, before these workers are stopped).

    Raises:
        WorkersUnkillable: A stalled worker survived SIGKILL past the bound.
    """
    seen = Seen(pages, rule, time.monotonic())
    waited_for_peer = waited_for_local = False
    held = 0
    while True:
        running = {p.local_rank: p for p in processes if p.returncode is None}
        watches, check = seen.check(running)
        if check.looks:
            await seen.look(running, check.looks, watches)
            continue
        stalled = await seen.confirm(running, check.stalled, watches)
        if not stalled:
            waited_for_peer = waited_for_local = False
            held = 0
            await anyio.sleep(max(check.next_check - time.monotonic(), 0.01))
            continue
        now = time.monotonic()
        stalls = _still_stalled(await _describe(pages, running, stalled, now, watches, seen.began))
        if not stalls:
            continue  # they made progress while they were looked at
        stalls = seen.leave_to_peers(stalls, watches)
        if not stalls:
            continue
        bound = max(watches[s.local_rank].bound for s in stalls)  # type: ignore[union-attr]
        others = [w.deadline() for r, w in watches.items() if w is not None and r not in stalled]
        if waited_for_peer and not waited_for_local and others:
            # The peer they wait for may be a worker of this node that went silent while
            # they waited (late to start on a loaded machine): let its own deadline come
            # (once, at most a timeout), so that a stuck worker is stopped with those
            # waiting for it and named as the cause; one that makes progress is not.
            waited_for_local = True
            await anyio.sleep(max(min(max(others), now + bound) - now, 0.01))
            continue
        if not waited_for_peer and all(s.in_collective for s in stalls):
            waited_for_peer = True
            report(stalls, True)
            # The peer's agent may need the dump's whole bound to find its worker silent.
            await anyio.sleep(_peer_wait(stalls, watches))
            continue  # then look again: moving again, or stalled (with whoever stalled since)
        if waited_for_peer and held < HOLDS and elsewhere is not None and await elsewhere():
            # The peer's agent named its own worker the root cause of this round: the group
            # change that follows stops these workers, with no restart spent here. On a
            # loaded machine it may come after the wait above; held a few more waits.
            held += 1
            await anyio.sleep(_peer_wait(stalls, watches))
            continue
        report(stalls, False)
        await _kill([running[s.local_rank] for s in stalls], grace)
        await anyio.sleep_forever()


#: How many more waits for a peer a node gives when the job's root cause is another node's.
HOLDS = 5


def _peer_wait(stalls: Sequence[Stall], watches: Mapping[int, Watch | None]) -> float:
    """How long a node whose stalled workers all wait in collectives gives the peer's agent:
    one more timeout (a number's rule), or at start-up up to a minute (the peers' workers
    started with these, within seconds); at least the dump's bound and a second."""
    phases = {w.phase: w.bound for s in stalls if (w := watches.get(s.local_rank)) is not None}
    fixed = phases.get("fixed")
    wait = fixed if fixed is not None else min(max(phases.values(), default=0.0), 60.0)
    return max(wait, DUMP_WAIT + 1.0)


async def _describe(
    pages: ProgressPages,
    running: Mapping[int, WorkerProcess],
    ranks: Sequence[int],
    now: float,
    watches: Mapping[int, Watch | None],
    began: float,
) -> list[Stall]:
    readings = {rank: pages.read(rank) for rank in ranks}
    frozen = {rank for rank, r in readings.items() if stopped(r.pid or running[rank].pid)}
    targets = [
        (r.pid, r.stack_signal, pages.stacks_file(rank))
        for rank, r in readings.items()
        if r.stack_signal and rank not in frozen and _ours(r.pid, running[rank].pid)
    ]
    dumps = await dump_stacks(targets) if targets else {}
    # Read again once the stacks are in: a step made since the verdict (or while the stacks
    # were taken) is seen, and that worker is no longer idle (see :func:`_still_stalled`).
    now = max(now, time.monotonic())
    readings = {rank: pages.read(rank) for rank in ranks}
    stalls = []
    for rank, reading in readings.items():
        text = dumps.get(reading.pid, "")
        stack = main_stack(parse_stacks(text), reading.main_thread)
        top, mine = where(stack)
        watch = watches.get(rank)
        last = reading.last_ns / 1e9 if reading.steps else began  # before a step: its start
        stalls.append(
            Stall(
                local_rank=rank,
                pid=reading.pid or running[rank].pid,
                steps=reading.steps,
                idle=max(now - last, 0.0),
                stacks=text,
                where=top,
                user_where=mine,
                in_collective=in_collective(stack),
                stopped=rank in frozen or stopped(reading.pid or running[rank].pid),
                phase="fixed" if watch is None else watch.phase,
                bound=0.0 if watch is None else watch.bound,
            )
        )
    return stalls


def _still_stalled(stalls: list[Stall]) -> list[Stall]:
    """The stalls whose worker made no progress since it was found stalled: under load, the
    verdict, the look from outside and the stacks take seconds, and a long phase may end
    meanwhile (a worker killed then was named hung "for 0.0 s")."""
    return [s for s in stalls if s.bound <= 0.0 or s.idle >= s.bound]


def _ours(pid: int, worker_pid: int) -> bool:
    """Whether ``pid`` (from a page) runs in the process group of the worker ``worker_pid``
    (never signal a pid that was reused by another process)."""
    try:
        return pid != 0 and os.getpgid(pid) == worker_pid
    except OSError:
        return False


async def _kill(stalled: Sequence[WorkerProcess], grace: float) -> None:
    for proc in stalled:
        proc.signal_group(signal.SIGKILL)
    bound = unkillable_bound(grace)
    with anyio.move_on_after(bound):
        for proc in stalled:
            await proc.wait()
    survivors = [inspect(p.pid, p.local_rank) for p in stalled if p.returncode is None]
    for proc in stalled:
        if proc.returncode is None:
            proc.abandon()
    if survivors:
        raise WorkersUnkillable(survivors, bound)
