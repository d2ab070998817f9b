"""How a run of the agent ends: success past the exit barrier, and the cleanup after any end.

How it works: the one place that ends a run. :func:`finish` takes the workers' return
values, sweeps what is left of them, waits at the exit barrier
(:func:`~aelastic.agent.loop.round.exit_barrier`) and, once the barrier saw every member
done, closes the rendezvous: the job is over. :func:`shutdown` runs after whatever ended
``run()`` (a return, an error, a cancellation; the caller shields it): the in-place channel
closed, the spares closed, the workers stopped (SIGTERM, grace, SIGKILL) and reaped and the
master port released (:meth:`~aelastic.agent.loop.attempt.Attempts.close`), the rendezvous
left (closed first after a failure, or an error of the agent's own, when
``close_on_failure``), the agent's beat page removed, the fork server closed and the run's
scratch and disposable log directories removed
(:meth:`~aelastic.agent.loop.run.RunPlace.close`), the guardian helper ended when no other
run of the process has workers, ``Finished`` published. Each is given the objects it acts
on, never the agent.
"""

from __future__ import annotations

import logging
from contextlib import suppress
from typing import TYPE_CHECKING

import anyio

from ...core.errors import RendezvousError
from ..api import RunResult, WorkerGroup, WorkerState
from ..events import Finished
from ..health.heal import NodeQuarantined, last_word
from ..output.publish import AgentPublisher
from ..processes.process import retire_guardian
from ..processes.unkillable import WorkersUnkillable
from .aio import quietly
from .attempt import Attempts
from .recover import PeerLoss
from .round import exit_barrier
from .run import RunPlace
from .signals import SignalException

if TYPE_CHECKING:
    from ...rendezvous.handler import DynamicRendezvousHandler

__all__ = ["finish", "shutdown"]

log = logging.getLogger("aelastic.agent")


async def finish(
    attempts: Attempts,
    place: RunPlace,
    handler: DynamicRendezvousHandler,
    group: WorkerGroup,
    events: AgentPublisher,
) -> RunResult:
    """End a run whose workers all succeeded: their return values, past the exit barrier
    (once every member is done, the job is over: the rendezvous is closed)."""
    values = attempts.return_values()
    await attempts.stop(WorkerState.SUCCEEDED)  # reaped already; sweeps leftovers
    spec = group.spec
    complete = await exit_barrier(handler, place.round, events, spec.exit_barrier_timeout)
    if complete:
        with anyio.move_on_after(last_word(handler)), suppress(RendezvousError):
            await handler.set_closed()
    log.info("workers of role '%s' succeeded", spec.role)
    return RunResult(WorkerState.SUCCEEDED, return_values=values)


def _own_error(error: BaseException | None) -> bool:
    """Whether the run ended on an error of this agent's own (its workers could not be
    started, ...): torch's ``launch_agent`` then shuts the rendezvous down, as after a
    failure. Not a rendezvous error (the rendezvous itself failed or closed), a quarantine
    or unkillable workers (this node leaves, the others go on without it) or a signal."""
    return isinstance(error, Exception) and not isinstance(
        error, RendezvousError | NodeQuarantined | WorkersUnkillable | SignalException
    )


async def shutdown(
    attempts: Attempts,
    place: RunPlace,
    peer: PeerLoss,
    handler: DynamicRendezvousHandler,
    events: AgentPublisher,
    result: RunResult | None,
    error: BaseException | None = None,
) -> None:
    """Stop and reap every worker, close the rendezvous after a failure or an error of this
    agent's own (``close_on_failure``), leave it, release what the run made."""
    spec = place.spec
    try:
        await peer.aclose()
        await peer.channel.aclose()
        with suppress(WorkersUnkillable):  # told already; leave all the same
            await attempts.close()
        if place.joined:
            place.joined = False
            failed = (result is not None and result.is_failed()) or _own_error(error)
            if failed and spec.close_on_failure:
                with anyio.move_on_after(last_word(handler)):
                    await quietly(handler.set_closed(), "close the rendezvous")
            succeeded = result is not None and result.state is WorkerState.SUCCEEDED
            with anyio.move_on_after(last_word(handler)):
                await quietly(handler.leave(finished=succeeded), "leave the rendezvous")
    finally:
        await attempts.beat.aclose()  # it beat until the workers were stopped
        await place.close()
        await retire_guardian()  # no helper process outlives the run
        reason = "cancelled or error" if result is None else result.state.value
        events.publish(Finished, reason=reason)
        events.close()
