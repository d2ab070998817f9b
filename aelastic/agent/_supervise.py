"""Supervision of one attempt: worker exits raced against changes of the rendezvous group.

How it works: :func:`supervise` races two loops with :func:`~aelastic.core.race.first_of`
(one anyio task group; the loser is cancelled, and when both end at once the exits are looked
at first). One awaits the workers' exits (pidfds, nothing polls) until a worker fails or all
succeeded; the other awaits the changes of the group (the backend wakes the handler) and asks
the policy what each means, publishing every change, until one calls for action. The
attempt's outcome is what the policy needs next: an observation and the failures.
"""

from __future__ import annotations

import logging

from ..core.race import first_of
from ..core.view import MembershipView
from ._publish import AgentPublisher
from .api import ProcessFailure, WorkerGroup, WorkerState
from .events import WorkerExited
from .membership import RoundGroup
from .policy import Action, Observation, Trigger, decide
from .process import WorkerProcess
from .workers import WorkerSet

__all__ = ["supervise"]

log = logging.getLogger("aelastic.agent")

Outcome = tuple[Observation, dict[int, ProcessFailure]]


async def supervise(
    workers: WorkerSet,
    group: WorkerGroup,
    round_group: RoundGroup,
    events: AgentPublisher,
    restarts_left: int,
) -> Outcome:
    """Wait for the first thing that calls for action in the attempt of ``workers``.

    Returns:
        What happened (for :func:`~aelastic.agent.policy.decide`) and who failed.
    """

    async def exits() -> Outcome:
        running = list(workers.processes)
        while running:
            await first_of(*(p.wait for p in running))
            for proc in [p for p in running if p.returncode is not None]:
                running.remove(proc)
                _exited(proc, group, events)
            failed = [p for p in workers.processes if p.returncode not in (None, 0)]
            if failed:
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

    _, outcome = await first_of(exits, group_change)
    result: Outcome = outcome
    return result


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
