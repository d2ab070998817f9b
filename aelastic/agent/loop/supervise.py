"""Supervision of one attempt: worker exits raced against changes of the rendezvous group.

How it works: :func:`supervise` races two loops with :func:`~aelastic.core.race.first_of` (one anyio
task group; the loser is cancelled, and when both end at once the exits are looked at first). One
awaits the workers' exits (pidfds, nothing polls) until a worker fails or all succeeded; the other
awaits the changes of the group (the backend wakes the handler) and asks the policy what each means,
publishing every change, until one calls for action. With hang detection on (the default), a third
one watches the workers' progress (:mod:`aelastic.agent.health.stall`): it stops a stalled worker,
whose exit then ends the attempt as a failure. Workers that recover in place
(:mod:`aelastic.agent.processes.inplace`) add two: a worker that says its collective broke waits for
the group change that explains it (``grace``: the heartbeat window and a little more), else it is
told to fail (its exit is then a failure like any other); and workers resumed in a new group must
say they joined it within ``recovery_timeout``, else they are restarted the old way. Any worker that
says it is failing in a collective (the bootstrap's exception hook, seconds before its process is
gone) makes the agent ask the backend at once which members' connections ended (a peer's loss is
then known, and the group changes, before the worker has exited). Workers killed while the agent was
frozen past the deadline they watch (:mod:`aelastic.agent.processes.beat`: they stopped themselves)
end the attempt as a lapse, not a failure. The attempt's outcome is what the policy needs next: an
observation and the failures.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from functools import partial

import anyio

from ...core.race import first_of
from ...core.view import MembershipView
from ..api import ProcessFailure, WorkerGroup, WorkerState
from ..events import WorkerExited, WorkerStalled
from ..health.stall import Stall, watch_stalls
from ..output.publish import AgentPublisher
from ..processes.beat import AgentBeat
from ..processes.group import WorkerSet
from ..processes.inplace import InPlaceChannel
from ..processes.process import WorkerProcess
from ..processes.unkillable import WorkersUnkillable
from .membership import RoundGroup
from .policy import Action, Observation, Trigger, decide

__all__ = ["supervise"]

log = logging.getLogger("aelastic.agent")

Outcome = tuple[Observation, dict[int, ProcessFailure]]


async def supervise(
    workers: WorkerSet,
    group: WorkerGroup,
    round_group: RoundGroup,
    events: AgentPublisher,
    restarts_left: int,
    inplace: InPlaceChannel | None = None,
    grace: float = 0.0,
    recovery_timeout: float = 60.0,
    beat: AgentBeat | None = None,
    check_departures: Callable[[], object] = lambda: None,
) -> Outcome:
    """Wait for the first thing that calls for action in the attempt of ``workers``;
    ``check_departures()`` when a worker says it is failing in a collective.

    Returns:
        What happened (for :func:`~aelastic.agent.loop.policy.decide`) and who failed.
    """
    began = time.monotonic()

    async def exits() -> Outcome:
        running = list(workers.processes)
        while running:
            await first_of(*(p.wait for p in running))
            for proc in [p for p in running if p.returncode is not None]:
                running.remove(proc)
                _exited(proc, group, events)
            failed = [p for p in workers.processes if p.returncode not in (None, 0)]
            # Workers stopped together for a stall (SIGKILLed) die at once: all are failures.
            if failed and not any(p.local_rank in workers.stalls for p in running):
                killed = all(p.returncode == -signal.SIGKILL for p in failed)
                if killed and beat is not None and beat.lapsed(began):
                    return Observation(Trigger.AGENT_LAPSED), {}  # they stopped themselves
                events.set_state(WorkerState.FAILED)
                return Observation(Trigger.WORKER_FAILED), workers.failures(failed)
        events.set_state(WorkerState.SUCCEEDED)
        return Observation(Trigger.WORKERS_SUCCEEDED), {}

    async def group_change() -> Outcome:
        since: MembershipView | None = None
        while True:
            since = await round_group.next_change(since)
            observation = await round_group.observe(since)
            decision = decide(observation, restarts_left)
            log.info("rendezvous group changed (%s): %s", decision.reason, decision.action.value)
            events.membership(since, ignored=decision.action is Action.CONTINUE)
            if decision.action is not Action.CONTINUE:
                return observation, {}

    async def stalls() -> Outcome:
        rule, pages = group.spec.hang_rule(), workers.progress
        if rule is None or pages is None:
            await anyio.sleep_forever()
        assert rule is not None and pages is not None
        grace = group.spec.stop_grace_period
        report = partial(_stalled, workers, group, events)
        try:
            await watch_stalls(
                pages, workers.processes, rule, report, grace, round_group.failed_elsewhere
            )
        except WorkersUnkillable as exc:
            workers.abandon(exc.survivors)  # not waited for again when the group stops
            events.unkillable(exc)
            raise
        raise AssertionError("watch_stalls returned")  # pragma: no cover

    async def broken() -> Outcome:
        if inplace is None:
            await anyio.sleep_forever()
        assert inplace is not None
        while True:
            await inplace.broken.wait()
            if not inplace.broken_workers(workers.processes):
                inplace.broken.clear()  # those that said so joined their group since
                continue
            async with anyio.create_task_group() as tasks:  # a peer's loss ends it first
                tasks.start_soon(round_group.report_departures)
                await anyio.sleep(grace)
                tasks.cancel_scope.cancel()
            failing = inplace.broken_workers(workers.processes)
            log.warning("no peer was lost: workers %s fail with their own error", failing)
            inplace.fail(failing)  # their exits are failures
            inplace.told_fail = True
            inplace.broken.clear()

    async def failing() -> Outcome:
        if inplace is None:
            await anyio.sleep_forever()
        assert inplace is not None
        while True:
            await inplace.failing.wait()
            inplace.failing.clear()
            ending = inplace.ending(workers.processes).values()
            if any(e.in_collective for e in ending):
                break
        check_departures()  # a task of its own: the group change ends the attempt
        await anyio.sleep_forever()
        raise AssertionError("unreachable")  # pragma: no cover

    async def recovery() -> Outcome:
        if inplace is None or inplace.gen == 0:
            await anyio.sleep_forever()
        assert inplace is not None
        with anyio.move_on_after(recovery_timeout):
            await inplace.all_joined([p.pid for p in workers.processes])
            await anyio.sleep_forever()
        return Observation(Trigger.RECOVERY_TIMED_OUT), {}

    _, outcome = await first_of(exits, group_change, stalls, broken, failing, recovery)
    result: Outcome = outcome
    return result


def _stalled(
    workers: WorkerSet,
    group: WorkerGroup,
    events: AgentPublisher,
    stalls: list[Stall],
    waiting_for_peer: bool,
) -> None:
    """Tell of ``stalls`` (events, stacks written to the log directory); unless the node
    waits for a peer first, mark them for their failures and the health check."""
    host = group.spec.rdzv_handler.node.addr
    for stall in stalls:
        worker = group.workers[stall.local_rank]
        saved = "" if waiting_for_peer else workers.save_stacks(stall)
        if not waiting_for_peer:
            workers.stalls[stall.local_rank] = stall
        log.warning("worker rank %d on %s %s", worker.global_rank, host, stall.describe())
        events.publish(
            WorkerStalled,
            local_rank=stall.local_rank,
            global_rank=worker.global_rank,
            pid=stall.pid,
            host=host,
            steps=stall.steps,
            idle=round(stall.idle, 3),
            where=stall.where,
            user_where=stall.user_where,
            in_collective=stall.in_collective,
            stopped=stall.stopped,
            waiting_for_peer=waiting_for_peer,
            phase=stall.phase,
            bound=round(stall.bound, 3),
            stacks_file=saved,
            stacks=stall.stacks[:_EVENT_STACKS],
        )


#: Characters of a stall's stacks an event carries (the file has them all).
_EVENT_STACKS = 16384


def _exited(proc: WorkerProcess, group: WorkerGroup, events: AgentPublisher) -> None:
    worker = group.workers[proc.local_rank]
    code = proc.returncode
    assert code is not None
    log.log(
        logging.INFO if code == 0 else logging.WARNING,
        "worker local_rank %d (rank %d, pid %d) exited with %s",
        proc.local_rank,
        worker.global_rank,
        proc.pid,
        code,
    )
    events.publish(
        WorkerExited,
        local_rank=proc.local_rank,
        global_rank=worker.global_rank,
        pid=proc.pid,
        exitcode=code,
    )
