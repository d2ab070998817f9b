"""The agent's steps on a rendezvous round: form the worker group from it, the exit barrier.

How it works: once ``next_rendezvous()`` returned, :func:`form_round` publishes this node's
record in the round's store and reads every member's (:func:`~.ranks.exchange_ranks`; group
rank 0's record carries the master address and the port it keeps bound until its workers
start), raced against a change of the group; the worker group then holds its ranks.
:func:`exit_barrier` waits for every member to succeed (:meth:`RoundGroup.exit_barrier`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from ..core.errors import RendezvousError, reason
from ..core.info import RendezvousInfo
from ..core.store import Store
from ..rendezvous.handler import DynamicRendezvousHandler
from ._publish import AgentPublisher
from .api import WorkerGroup
from .events import ExitBarrier, RendezvousCompleted
from .membership import RoundGroup
from .ranks import AgentRecord, ReservedPort, exchange_ranks

__all__ = ["exit_barrier", "form_round"]

log = logging.getLogger("aelastic.agent")


async def form_round(
    handler: DynamicRendezvousHandler,
    info: RendezvousInfo[Store],
    group: WorkerGroup,
    port: ReservedPort,
    events: AgentPublisher,
    restarts_left: int,
    started: float,
) -> RoundGroup:
    """Give ``group`` its ranks in the round of ``info`` (``started``: when the rendezvous
    began, monotonic); the round's group of members."""
    spec = group.spec
    store, group_rank = info.store, info.rank
    mine = AgentRecord(spec.role, spec.local_world_size, handler.node)
    if group_rank == 0:
        addr = spec.master_addr or spec.local_addr or handler.node.addr
        master_port = spec.master_port or port.reserve()
        mine = replace(mine, master_addr=addr, master_port=master_port)
    round_group = RoundGroup(handler, store)
    timeout = handler.settings.join_timeout
    exchange = exchange_ranks(store, group_rank, info.world_size, mine, timeout)
    mine_assigned = await round_group.unless_changed(exchange, restarts_left)
    group.store = store
    group.group_rank = group_rank
    group.group_world_size = info.world_size
    group.master_addr = mine_assigned.master_addr
    group.master_port = mine_assigned.master_port
    group.workers = mine_assigned.workers()
    group.round = handler.round
    duration = time.monotonic() - started
    log.info("rendezvous round %s complete in %.3f s: %r", group.round, duration, group)
    events.publish(
        RendezvousCompleted,
        group_rank=group_rank,
        group_world_size=info.world_size,
        world_size=group.workers[0].world_size,
        duration=duration,
    )
    return round_group


async def exit_barrier(
    handler: DynamicRendezvousHandler,
    group: WorkerGroup,
    round_group: RoundGroup | None,
    events: AgentPublisher,
    timeout: float,
) -> bool:
    """Wait at the exit barrier; whether every member of the round succeeded."""
    assert round_group is not None and group.group_rank is not None
    assert group.group_world_size is not None
    started = time.monotonic()
    complete = False
    try:
        complete = await round_group.exit_barrier(handler.node, group.group_world_size, timeout)
    except RendezvousError as exc:
        log.warning("exit barrier failed: %s", reason(exc))
    duration = time.monotonic() - started
    if not complete:
        log.warning("exit barrier incomplete after %.3f s; leaving anyway", duration)
    events.publish(ExitBarrier, duration=duration, complete=complete)
    return complete
