"""The agent's steps on a rendezvous round: form the worker group from it, the exit barrier.

How it works: this node's join said its worker role, how many workers it runs and the port
it offers for their bootstrap (:func:`prepare_join`); once ``next_rendezvous()`` returned,
its answer holds where the node's workers stand in the round and group rank 0's address
and port, all fixed by the rendezvous from what each member said of itself
(:func:`form_round`): nothing is read from the members' store, which any store client can
write. :func:`exit_barrier` waits for every member to succeed (:meth:`RoundGroup.exit_barrier`).
"""

from __future__ import annotations

import logging
import time

from ...core.errors import RendezvousError, RendezvousStateError, reason
from ...core.info import RendezvousInfo
from ...core.store import Store
from ...rendezvous.handler import DynamicRendezvousHandler
from ..api import WorkerGroup, WorkerSpec
from ..events import ExitBarrier, RendezvousCompleted
from ..output.publish import AgentPublisher
from .membership import RoundGroup
from .ranks import ReservedPort, workers_of

__all__ = ["exit_barrier", "form_round", "prepare_join"]

log = logging.getLogger("aelastic.agent")


def prepare_join(handler: DynamicRendezvousHandler, spec: WorkerSpec, port: ReservedPort) -> None:
    """Have the next join say this node's worker role and count, and offer a port for the
    workers' bootstrap (``spec.master_port``, or one kept bound until the round is known)."""
    offered = spec.master_port or port.reserve()
    handler.set_profile(spec.role, spec.local_world_size, offered, spec.local_addr)


async def form_round(
    handler: DynamicRendezvousHandler,
    info: RendezvousInfo[Store],
    group: WorkerGroup,
    port: ReservedPort,
    events: AgentPublisher,
    started: float,
) -> RoundGroup:
    """Give ``group`` its ranks in the round of ``info`` (``started``: when the rendezvous
    began, monotonic); the round's group of members.

    Raises:
        RendezvousStateError: The rendezvous placed no workers (a backend of an older
            version of aelastic).
    """
    spec = group.spec
    placement = handler.placement
    if placement is None:
        raise RendezvousStateError(
            f"the rendezvous of run '{handler.get_run_id()}' gave no worker ranks: is the "
            "server or store of another version of aelastic?"
        )
    if info.rank != 0:
        port.release()  # only group rank 0's port is the workers'
    bootstrap = info.bootstrap_store_info
    assert bootstrap is not None  # aelastic's handler always answers it
    group.store = info.store
    group.group_rank = info.rank
    group.group_world_size = info.world_size
    group.master_addr = spec.master_addr or bootstrap.master_addr
    group.master_port = spec.master_port or bootstrap.master_port
    group.workers = workers_of(placement, spec.local_world_size)
    group.round = handler.round
    duration = time.monotonic() - started
    log.info("rendezvous round %s complete in %.3f s: %r", group.round, duration, group)
    events.publish(
        RendezvousCompleted,
        group_rank=info.rank,
        group_world_size=info.world_size,
        world_size=placement.world,
        duration=duration,
    )
    return RoundGroup(handler, info.store)


async def exit_barrier(
    handler: DynamicRendezvousHandler,
    round_group: RoundGroup | None,
    events: AgentPublisher,
    timeout: float,
) -> bool:
    """Wait at the exit barrier; whether every member of the round succeeded."""
    assert round_group is not None
    started = time.monotonic()
    complete = False
    try:
        complete = await round_group.exit_barrier(timeout)
    except RendezvousError as exc:
        log.warning("exit barrier failed: %s", reason(exc))
    duration = time.monotonic() - started
    if not complete:
        log.warning("exit barrier incomplete after %.3f s; leaving anyway", duration)
    events.publish(ExitBarrier, duration=duration, complete=complete)
    return complete
