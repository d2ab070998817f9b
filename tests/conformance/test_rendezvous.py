"""Rendezvous scenarios that every backend must pass, through the async handler."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest

from aelastic import (
    RendezvousClosedError,
    RendezvousGracefulExitError,
    RendezvousTimeoutError,
)
from aelastic.core.state import Snapshot
from aelastic.rendezvous import DynamicRendezvousHandler
from tests._rendezvous_helpers import (
    PROMPT,
    assert_one_group,
    eventually,
    handler_group,
    join_all,
)

from .conftest import MakeParams

pytestmark = pytest.mark.anyio


@asynccontextmanager
async def handlers(
    make: MakeParams, count: int, min_nodes: int, max_nodes: int, **conf: object
) -> AsyncIterator[list[DynamicRendezvousHandler]]:
    params = make(min_nodes, max_nodes, **conf)
    async with handler_group(
        params.backend, params.endpoint, params.run_id, count, min_nodes, max_nodes, **params.config
    ) as made:
        yield made


async def stored(handler: DynamicRendezvousHandler) -> Snapshot:
    snapshot = await handler.backend.snapshot()
    assert snapshot is not None
    return snapshot


async def test_nodes_form_one_group_with_agreed_ranks(make_params: MakeParams) -> None:
    async with handlers(make_params, 4, 4, 4) as group:
        infos = await join_all(group)
        assert_one_group(infos, 4)
        state = await stored(group[0])
        assert state.status.complete
        assert {h.node: i.rank for h, i in zip(group, infos, strict=True)} == state.ranks()


async def test_last_call_completes_with_min_nodes(make_params: MakeParams) -> None:
    async with handlers(make_params, 2, 2, 4, last_call_timeout=0.3) as group:
        start = anyio.current_time()
        infos = await join_all(group)
        assert anyio.current_time() - start >= 0.3
        assert_one_group(infos, 2)


async def test_latecomer_waits_and_joins_the_next_round(make_params: MakeParams) -> None:
    async with handlers(make_params, 3, 2, 3) as group:
        first, second, late = group
        infos = await join_all([first, second])
        round0 = (await stored(first)).status.round
        late_join = asyncio.ensure_future(late.next_rendezvous())
        with anyio.fail_after(PROMPT):
            seen = await first.watch()
        assert seen.waiting == 1 and not seen.lost
        assert await second.num_nodes_waiting() == 1
        infos = await join_all([first, second])
        with anyio.fail_after(PROMPT):
            infos.append(await late_join)
        assert_one_group(infos, 3)
        assert (await stored(first)).status.round == round0 + 1


async def test_redundant_node_waits_silently_and_exits_gracefully(make_params: MakeParams) -> None:
    async with handlers(make_params, 3, 1, 2) as group:
        first, second, extra = group
        await join_all([first, second])
        async with extra.events() as events:
            extra_join = asyncio.ensure_future(extra.next_rendezvous())
            with anyio.fail_after(PROMPT):
                while getattr(await events.get(), "transition", "") != "add_to_redundancy_list":
                    pass
        assert await first.num_nodes_waiting() == 0
        await first.set_closed()
        with anyio.fail_after(PROMPT), pytest.raises(RendezvousGracefulExitError):
            await extra_join


async def test_closed_rendezvous_stays_closed(make_params: MakeParams) -> None:
    async with handlers(make_params, 2, 1, 1) as (first, other):
        await join_all([first])
        assert not await other.is_closed()
        await first.set_closed()
        assert await other.is_closed()
        with pytest.raises(RendezvousClosedError):
            await other.next_rendezvous()
        with pytest.raises(RendezvousClosedError):
            await first.next_rendezvous()
        await other.set_closed()  # idempotent
        assert (await stored(first)).status.closed


async def test_shutdown_closes_for_every_node(make_params: MakeParams) -> None:
    async with handlers(make_params, 2, 1, 2) as (first, other):
        await join_all([first])
        assert await first.shutdown() is True
        assert await other.is_closed()


async def test_join_timeout_raises_and_leaves_the_state_clean(make_params: MakeParams) -> None:
    async with handlers(make_params, 1, 2, 2, join_timeout=0.5) as (alone,):
        with anyio.fail_after(PROMPT), pytest.raises(RendezvousTimeoutError):
            await alone.next_rendezvous()
        state = await stored(alone)
        assert not state.knows(alone.node)


async def test_cancelled_join_leaves_the_state_clean(make_params: MakeParams) -> None:
    async with handlers(make_params, 1, 2, 2) as (node,):
        async with node.events() as events:
            join = asyncio.ensure_future(node.next_rendezvous())
            with anyio.fail_after(PROMPT):
                while getattr(await events.get(), "transition", "") != "add_to_participants":
                    pass
        assert (await stored(node)).knows(node.node)
        join.cancel()
        with pytest.raises(asyncio.CancelledError):
            await join

        async def gone() -> bool:
            return not (await stored(node)).knows(node.node)

        await eventually(gone)


async def test_member_that_leaves_is_seen_by_the_others(make_params: MakeParams) -> None:
    async with handlers(make_params, 2, 1, 2) as (stay, go):
        await join_all([stay, go])
        await go.leave()
        with anyio.fail_after(PROMPT):
            seen = await stay.watch()
        assert seen.lost == {go.node} and not seen.closed
        assert not await stay.is_closed()


async def test_dead_member_is_pruned_and_survivor_reforms(make_params: MakeParams) -> None:
    conf = {"keep_alive_interval": 0.2, "keep_alive_max_attempt": 2, "last_call_timeout": 0.1}
    async with handlers(make_params, 2, 1, 2, **conf) as (survivor, victim):
        await join_all([survivor, victim])
        await victim._heartbeats.stop()  # dies: silent, never leaves
        start = anyio.current_time()
        with anyio.fail_after(PROMPT):
            seen = await survivor.watch()
        assert seen.lost == {victim.node}
        assert anyio.current_time() - start >= 0.3  # not before the heartbeat window
        (info,) = await join_all([survivor])
        assert info.world_size == 1 and info.rank == 0
        assert not (await stored(survivor)).knows(victim.node)


@pytest.mark.parametrize(
    ("min_nodes", "attempts", "interval"),
    # (1, 2): one node of at most two waits out the last call, then the thinnest window
    # (two beats: 0.8 s, so that a loaded machine's delays fit in it).
    [(2, 3, 0.2), (1, 2, 0.4)],
)
async def test_heartbeats_keep_live_members_in_the_group(
    make_params: MakeParams, min_nodes: int, attempts: int, interval: float
) -> None:
    conf = {
        "keep_alive_interval": interval,
        "keep_alive_max_attempt": attempts,
        "last_call_timeout": 0.4,  # completes when a keep-alive is due, too
    }
    async with handlers(make_params, min_nodes, min_nodes, 2, **conf) as group:
        await join_all(group)
        with anyio.move_on_after(1.5) as scope:
            await group[0].watch()
        assert scope.cancelled_caught, "a live member was reported lost"
        state = await stored(group[0])
        assert set(state.ranks()) == {h.node for h in group}


async def test_rounds_get_separate_stores(make_params: MakeParams) -> None:
    async with handlers(make_params, 1, 1, 1) as (node,):
        first = await node.next_rendezvous()
        await first.store.set("key", b"round-0")
        second = await node.next_rendezvous()
        assert await second.store.try_get("key") is None
        assert await first.store.get("key") == b"round-0"


async def test_a_member_needs_nothing_of_rank_0_once_the_round_is_complete(
    make_params: MakeParams,
) -> None:
    """Rank 0 going silent right after completion never holds up the others: each member
    learns its rank and the bootstrap address from its own join's answer."""
    async with handlers(make_params, 2, 2, 2) as (first, second):
        joins = [asyncio.ensure_future(h.next_rendezvous()) for h in (first, second)]
        with anyio.fail_after(PROMPT):
            infos = await asyncio.gather(*joins)
        rank0 = first if infos[0].rank == 0 else second
        other_info = infos[1] if rank0 is first else infos[0]
        await rank0._heartbeats.stop()  # silent from now on
        boot = other_info.bootstrap_store_info
        assert boot is not None and boot.master_addr == "127.0.0.1" and boot.master_port > 0
        assert {i.bootstrap_store_info.master_port for i in infos if i.bootstrap_store_info} == {
            boot.master_port
        }


async def test_cancelled_join_of_a_complete_round_leaves(make_params: MakeParams) -> None:
    """Cancelled after the round completed (before the caller saw it): the node leaves."""
    async with handlers(make_params, 2, 2, 2) as (first, second):
        joins = [asyncio.ensure_future(h.next_rendezvous()) for h in (first, second)]
        await asyncio.gather(*joins)
        third_join = asyncio.ensure_future(first.next_rendezvous())  # leaves, joins anew
        await asyncio.sleep(0.05)
        third_join.cancel()
        await asyncio.gather(third_join, return_exceptions=True)

        async def gone() -> bool:
            return not (await stored(second)).knows(first.node)

        await eventually(gone)


async def test_after_shutdown_the_handler_still_answers_as_torchs_does(
    make_params: MakeParams,
) -> None:
    async with handlers(make_params, 1, 1, 1) as (node,):
        await join_all([node])
        assert await node.shutdown() is True
        assert await node.shutdown() is True  # again: still True, nothing raised
        assert await node.is_closed() is True
        assert await node.num_nodes_waiting() == 0
        with pytest.raises(RendezvousClosedError):
            await node.next_rendezvous()


@pytest.mark.parametrize(
    ("endpoint", "message"),
    [
        ("~", "hostname of the rendezvous endpoint '~'"),
        ("~:123", "hostname of the rendezvous endpoint '~:123'"),
        ("dummy.com :123", "hostname of the rendezvous endpoint 'dummy.com :123'"),
        ("dummy.com:", "port number of the rendezvous endpoint 'dummy.com:'"),
    ],
)
@pytest.mark.parametrize("backend_name", ["redis", "http"])
def test_invalid_endpoints_fail_at_once_with_torchs_messages(
    backend_name: str, endpoint: str, message: str
) -> None:
    from aelastic import RendezvousParameters
    from aelastic.rendezvous import create_handler

    with pytest.raises(ValueError, match=message):
        create_handler(RendezvousParameters(backend_name, endpoint, "run", 1, 1))


async def test_a_departure_is_seen_before_the_first_heartbeat(make_params: MakeParams) -> None:
    # Heartbeats a minute apart: the members' first beats are seconds away, and a backend
    # whose beats bring the news (HTTP holds them) must not leave the watcher blind till then.
    async with handlers(make_params, 2, 2, 2, keep_alive_interval=60.0) as (stays, goes):
        await join_all([stays, goes])
        await goes.leave()
        with anyio.fail_after(PROMPT):
            seen = await stays.watch()
        assert seen.lost_count == 1 and not seen.removed
