"""How a run of the agent ends: success past the exit barrier, and the cleanup after any end.

How it works: :func:`finish` takes the workers' return values, sweeps what is left of them, waits at
the exit barrier (:func:`~aelastic.agent.loop.round.exit_barrier`) and, once the barrier saw every
member done, closes the rendezvous: the job is over. :func:`shutdown` runs after whatever ended
``run()`` (a return, an error, a cancellation; the caller shields it): standbys and the in-place
channel closed, workers stopped (SIGTERM, grace, SIGKILL) and reaped, the agent's beat page removed,
the master port released, the rendezvous left (closed first after a failure when
``close_on_failure``), the fork server closed, the guardian helper ended when no other run of the
process has workers, the run's scratch and disposable log directories removed, ``Finished``
published. Both act on the agent's own state, as its methods would; they live here so that
:mod:`aelastic.agent.loop.agent` keeps to its loop.
"""

from __future__ import annotations

import logging
import shutil
from contextlib import suppress
from typing import TYPE_CHECKING

import anyio

from ...core.errors import RendezvousError
from ..api import RunResult, WorkerState
from ..events import Finished
from ..health.errors import logs_disposable
from ..health.heal import NodeQuarantined
from ..processes.process import retire_guardian
from ..processes.unkillable import WorkersUnkillable
from .aio import quietly
from .round import exit_barrier
from .services import last_word
from .signals import SignalException

if TYPE_CHECKING:
    from .agent import ElasticAgent

__all__ = ["finish", "shutdown"]

log = logging.getLogger("aelastic.agent")


async def finish(agent: ElasticAgent) -> RunResult:
    """End the run of ``agent`` whose workers all succeeded: their return values."""
    assert agent._workers is not None
    values = agent._workers.return_values()
    await agent._stop_workers(WorkerState.SUCCEEDED)  # reaped already; sweeps leftovers
    complete = await exit_barrier(
        agent._handler, agent._group, agent._round, agent._events, agent._spec.exit_barrier_timeout
    )
    if complete:
        with anyio.move_on_after(last_word(agent._handler)), suppress(RendezvousError):
            await agent._handler.set_closed()
    log.info("workers of role '%s' succeeded", agent._spec.role)
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
    agent: ElasticAgent, result: RunResult | None, error: BaseException | None = None
) -> None:
    """Stop and reap every worker, close the rendezvous after a failure or an error of this
    agent's own (``close_on_failure``), leave it, release what the run made."""
    try:
        await agent._standbys.aclose()
        await agent._peer.aclose()
        await agent._peer.channel.aclose()
        with suppress(WorkersUnkillable):  # told already; leave all the same
            await agent._stop_workers(WorkerState.STOPPED)
        agent._port.release()
        if agent._joined:
            agent._joined = False
            failed = (result is not None and result.is_failed()) or _own_error(error)
            if failed and agent._spec.close_on_failure:
                with anyio.move_on_after(last_word(agent._handler)):
                    await quietly(agent._handler.set_closed(), "close the rendezvous")
            succeeded = result is not None and result.state is WorkerState.SUCCEEDED
            with anyio.move_on_after(last_word(agent._handler)):
                await quietly(agent._handler.leave(finished=succeeded), "leave the rendezvous")
    finally:
        await agent._beat.aclose()  # it beat until the workers were stopped
        forks, agent._forks = agent._forks, None
        if forks is not None:
            await forks.aclose()
        await retire_guardian()  # no helper process outlives the run
        for path in (agent._scratch, logs_disposable(agent._spec) and agent._own_log_root):
            if path:
                shutil.rmtree(path, ignore_errors=True)
        agent._scratch = None
        reason = "cancelled or error" if result is None else result.state.value
        agent._events.publish(Finished, reason=reason)
        agent._events.close()
