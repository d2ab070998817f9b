"""torch's semantics on every backend: ranks in the sorted order of node descriptors,
``MASTER_ADDR``/``MASTER_PORT`` in the round's store, and a job id used again once the job
that used it is over (a late node of that job still learns that it closed)."""

from __future__ import annotations

import asyncio
from typing import Any

import anyio
import pytest

from aelastic import RendezvousClosedError, RendezvousParameters, RendezvousStoreInfo
from aelastic.backends import create_backend
from aelastic.core.params import RendezvousSettings
from aelastic.rendezvous import DynamicRendezvousHandler, RendezvousWaiting
from tests._rendezvous_helpers import PROMPT, TEST_CONF, handler_group, join_all

from .conftest import MakeParams

pytestmark = pytest.mark.anyio

#: Short heartbeats: a 0.4 s window, so a closed run is free again 0.8 s after it emptied.
SHORT = {"keep_alive_interval": 0.2, "keep_alive_max_attempt": 2, "last_call_timeout": 0.1}


async def test_ranks_follow_the_sorted_node_descriptors_not_the_join_order(
    make_params: MakeParams,
) -> None:
    params = make_params(3, 3)
    async with handler_group(
        params.backend, params.endpoint, params.run_id, 3, 3, 3, **params.config
    ) as group:
        joins = []
        for handler in reversed(group):  # the last made (highest local id) joins first
            joins.append(asyncio.ensure_future(handler.next_rendezvous()))
            await asyncio.sleep(0.05)
        with anyio.fail_after(PROMPT):
            infos = await asyncio.gather(*joins)
        ranks = {h.node: i.rank for h, i in zip(reversed(group), infos, strict=True)}
        assert [ranks[n] for n in sorted(ranks)] == [0, 1, 2]


async def test_rank_0_publishes_master_addr_and_port_in_the_rounds_store(
    make_params: MakeParams,
) -> None:
    params = make_params(2, 2)
    async with handler_group(
        params.backend, params.endpoint, params.run_id, 2, 2, 2, **params.config
    ) as group:
        infos = await join_all(group)
        for info in infos:
            with anyio.fail_after(PROMPT):
                addr = await info.store.get(RendezvousStoreInfo.MASTER_ADDR_KEY)
                port = await info.store.get(RendezvousStoreInfo.MASTER_PORT_KEY)
            boot = info.bootstrap_store_info
            assert boot is not None
            assert (addr.decode(), int(port)) == (boot.master_addr, boot.master_port)
            assert boot.master_port > 0


async def _over(group: list[DynamicRendezvousHandler]) -> None:
    """The job ends as torch's does: every node shuts the rendezvous down."""
    for handler in group:
        assert await handler.shutdown() is True


async def test_a_job_id_is_used_again_once_the_job_is_over(make_params: MakeParams) -> None:
    params = make_params(2, 2, **SHORT)
    conf, where = params.config, (params.backend, params.endpoint, params.run_id)
    async with (
        handler_group(*where, 2, 2, 2, **conf) as old_job,
        handler_group(*where, 1, 2, 2, **conf) as (late,),
    ):
        await join_all(old_job)
        # The job runs a while: a late node of a job was made that long before the run
        # emptied (which is how it is told from a node of a new job, made after: by
        # durations, so a second keeps it apart from any answer's delay under load).
        await anyio.sleep(1.0)
        await _over(old_job)
        # A late node of the old job: the run closed, and says when its id is free again.
        with anyio.fail_after(PROMPT), pytest.raises(RendezvousClosedError) as closed:
            await late.next_rendezvous()
    reopens = closed.value.reopens_in
    assert reopens is not None and 0 < reopens <= 0.8, reopens
    assert "can use the id in 1 s" in str(closed.value), closed.value
    assert "--reset" in str(closed.value) and "another --rdzv-id" in str(closed.value)
    if params.backend != "memory":  # memory forgets a finished run once its handlers close
        await anyio.sleep(reopens + 0.1)
    # The next job (other node bounds: its own rules) forms a new run.
    async with handler_group(*where, 2, 2, 3, **conf) as next_job:
        infos = await join_all(next_job)
        assert sorted(i.rank for i in infos) == [0, 1] and infos[0].world_size == 2
        snapshot = await next_job[0].backend.snapshot()
        assert snapshot is not None and not snapshot.status.closed
        assert snapshot.rules is not None and snapshot.rules.max_nodes == 3


async def test_a_new_job_with_the_id_of_one_just_over_waits_for_it_then_starts(
    make_params: MakeParams,
) -> None:
    """The everyday re-run: a job ends and the same command starts again at once. Its nodes
    were made after the old job's last node left: they wait out the rest of the grace
    (saying so in a waiting event), then form a new run; no error."""
    params = make_params(2, 2, **SHORT)
    conf, where = params.config, (params.backend, params.endpoint, params.run_id)
    async with handler_group(*where, 2, 2, 2, **conf) as old_job:
        await join_all(old_job)
        await _over(old_job)
    async with handler_group(*where, 2, 2, 2, **conf) as next_job:
        events: list[object] = []
        next_job[0].add_listener(events.append)
        infos = await join_all(next_job)
    assert sorted(i.rank for i in infos) == [0, 1]
    waits = [e for e in events if isinstance(e, RendezvousWaiting) and e.id_wait]
    if params.backend != "memory":  # memory frees the id at once once its handlers let go
        assert waits and waits[0].id_wait == "closed", events
        assert waits[0].id_free_in is not None and 0 < waits[0].id_free_in <= 0.8


class _SlowAnswers:
    """A backend whose answers come late, as on a loaded machine: each request is applied
    at once, its reply handed over ``delay`` seconds later."""

    def __init__(self, backend: Any, delay: float) -> None:
        self._backend = backend
        self._delay = delay

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    async def apply(self, request: Any, hold: float = 0.0, seen: str | None = None) -> Any:
        reply = await self._backend.apply(request, hold, seen)
        await asyncio.sleep(self._delay)
        return reply


async def test_a_job_made_just_after_the_last_one_waits_for_its_id_when_answers_are_slow(
    make_params: MakeParams,
) -> None:
    """A job run again at once (a notebook's cell: its handler made milliseconds after the
    last one's node left), whose backend answers 0.3 s late: it is a new job (its handler
    was made after the run emptied), so it waits for the id, then starts; a slow answer
    does not make it look older than the emptiness."""
    params = make_params(1, 1, **SHORT)
    conf, where = params.config, (params.backend, params.endpoint, params.run_id)
    async with handler_group(*where, 1, 1, 1, **conf) as old_job:
        await join_all(old_job)
        await _over(old_job)
        new_params = RendezvousParameters(
            *where, 1, 1, local_addr="127.0.0.1", **{**TEST_CONF, **conf}
        )
        backend = _SlowAnswers(create_backend(new_params), 0.3)
        settings = RendezvousSettings.from_parameters(new_params)
        new = DynamicRendezvousHandler(backend, settings, local_addr="127.0.0.1")
        events: list[object] = []
        new.add_listener(events.append)
        try:
            with anyio.fail_after(PROMPT):
                info = await new.next_rendezvous()
        finally:
            await new.aclose()
    assert (info.rank, info.world_size) == (0, 1)
    waits = [e for e in events if isinstance(e, RendezvousWaiting) and e.id_wait]
    if params.backend != "memory":  # memory frees the id at once once its handlers let go
        assert waits and waits[0].id_wait == "closed", events


async def test_a_run_that_never_formed_is_free_after_the_grace(make_params: MakeParams) -> None:
    """A 2-node job stopped before its round formed leaves its run with 2:2 rules; a 1-node
    job with the same id starts once the grace has passed (it waits for it, not refused)."""
    params = make_params(2, 2, **SHORT)
    conf, where = params.config, (params.backend, params.endpoint, params.run_id)
    async with handler_group(*where, 1, 2, 2, **conf) as (alone,):
        with anyio.move_on_after(0.3):
            await alone.next_rendezvous()  # interrupted: its join is cancelled, it leaves
    async with handler_group(*where, 1, 1, 1, **conf) as (single,):
        with anyio.fail_after(PROMPT):
            info = await single.next_rendezvous()
        assert info.rank == 0 and info.world_size == 1
        snapshot = await single.backend.snapshot()
        assert snapshot is not None and snapshot.rules is not None
        assert (snapshot.rules.min_nodes, snapshot.rules.max_nodes) == (1, 1)
