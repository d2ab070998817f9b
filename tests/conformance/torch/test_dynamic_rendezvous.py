"""torch's ``test/distributed/elastic/rendezvous/dynamic_rendezvous_test.py``, part 1 of 3:
joining, the last call, max nodes, the wait and redundancy lists, rounds, keep-alive.

Every scenario runs on each backend (memory, Redis, HTTP, etcd, c10d) through the async
handler, and through torch's blocking names (``facade``) unless its course is set by time
alone (``ASYNC_ONLY``: the last call, heartbeats, pruning, a join's deadline). torch drives
its handler over a mocked state holder and reads the pickled state; here real nodes of one
run do the same and a handler that never joins reads the stored state (``observer``).

From torch's file, this module ports 26 tests as 16 scenarios (each names the tests it
stands for): ``IntegrationTest`` (3), ``DynamicRendezvousHandlerTest`` (4),
``DistributedRendezvousOpExecutorTest`` (6), ``TestRendezvousJoinOp`` (10),
``TestRendezvousKeepAliveOp`` (1), ``BackendRendezvousStateHolderTest`` (2). Part 2
(``test_dynamic_rendezvous_close``) has closing and shutdown, part 3
(``test_dynamic_rendezvous_settings``) the parameters, timeouts and node names; what of the
file is not ported, and why, is listed in part 3.
"""

from __future__ import annotations

import asyncio

import anyio
import pytest

from aelastic import RendezvousGracefulExitError, RendezvousStoreInfo, RendezvousTimeoutError
from tests._rendezvous_helpers import PROMPT

from .conftest import ASYNC_ONLY, SHORT_BEATS, NodeFactory, Observer, join_all, until

pytestmark = pytest.mark.anyio


async def test_all_nodes_join_rendezvous(nodes: NodeFactory) -> None:
    """IntegrationTest.test_all_nodes_join_rendezvous: two nodes, two ranks, one store."""
    first, second = await nodes(2, 2, 2)
    one, two = await join_all([first, second])
    assert {one.rank, two.rank} == {0, 1}
    assert one.world_size == two.world_size == 2
    await one.store.set("written-by-one", b"x")
    with anyio.fail_after(PROMPT):
        assert await two.store.get("written-by-one") == b"x"


async def test_next_rendezvous_returns_rank_and_world_size_of_the_round(
    nodes: NodeFactory,
) -> None:
    """DynamicRendezvousHandlerTest.test_next_rendezvous_returns_expected_value: the node
    that completes a round of three (max nodes) gets its rank in the sorted order, the world
    size, and the round's store."""
    group = await nodes(3, 1, 3)
    infos = await join_all(group)
    ranks = {node.node: info.rank for node, info in zip(group, infos, strict=True)}
    assert [ranks[n] for n in sorted(ranks)] == [0, 1, 2]
    assert {info.world_size for info in infos} == {3}
    boot = infos[0].bootstrap_store_info
    assert boot is not None
    for info in infos:
        with anyio.fail_after(PROMPT):
            addr = await info.store.get(RendezvousStoreInfo.MASTER_ADDR_KEY)
        assert addr.decode() == boot.master_addr


async def test_next_rendezvous_moves_to_next_round_if_called_repeatedly(
    nodes: NodeFactory, observer: Observer
) -> None:
    """DynamicRendezvousHandlerTest.test_next_rendezvous_moves_to_next_round_if_called_
    repeatedly, and ``test_run_removes_from_participants_and_moves_to_next_round_if_node_is_
    last_participant``: the only participant leaving its round for the next one."""
    (node,) = await nodes(1, 1, 1)
    for expected in range(4):
        info = await node.next_rendezvous()
        assert (info.rank, info.world_size) == (0, 1)
        status = (await observer()).status
        assert (status.round, status.complete) == (expected, True)


async def test_round_completes_at_once_when_max_nodes_is_reached(nodes: NodeFactory) -> None:
    """test_run_adds_to_participants_and_completes_rendezvous_if_max_nodes_is_reached: the
    last call is not waited out once the round is full."""
    group = await nodes(2, 1, 2, last_call_timeout=30)
    infos = await join_all(group, within=15)  # well before the 30 s last call
    assert sorted(i.rank for i in infos) == [0, 1]


@ASYNC_ONLY
async def test_round_completes_after_the_last_call_once_min_nodes_is_reached(
    nodes: NodeFactory, observer: Observer
) -> None:
    """test_run_adds_to_participants_and_starts_last_call_if_min_nodes_is_reached and
    TestRendezvousJoinOp.test_marks_rendezvous_complete_if_node_is_participant_and_last_call_
    deadline_exceeded: min nodes starts the last call; its end completes the round."""
    group = await nodes(2, 2, 3, last_call_timeout=0.4)
    started = anyio.current_time()
    joins = [asyncio.ensure_future(node.next_rendezvous()) for node in group]

    async def last_call_started() -> bool:
        status = (await observer()).status
        return status.participants == 2 and status.deadline_ms is not None

    await until(last_call_started)
    assert not (await observer()).status.complete
    with anyio.fail_after(PROMPT):
        infos = await asyncio.gather(*joins)
    assert anyio.current_time() - started >= 0.4
    assert sorted(i.world_size for i in infos) == [2, 2]


async def test_latecomer_is_added_to_the_wait_list_and_joins_the_next_round(
    nodes: NodeFactory, observer: Observer
) -> None:
    """TestRendezvousJoinOp.test_adds_to_wait_list_if_rendezvous_is_complete_and_num_nodes_
    is_less_than_max_nodes, test_waits_next_round_if_rendezvous_is_complete_and_node_is_in_
    wait_list and test_run_adds_to_participants_if_node_was_in_waitlist."""
    first, second, late = await nodes(3, 2, 3)
    await join_all([first, second])
    late_join = asyncio.ensure_future(late.next_rendezvous())

    async def waiting() -> bool:
        return [m.node for m in (await observer()).wait_list] == [late.node]

    await until(waiting)
    assert await first.num_nodes_waiting() == 1
    infos = await join_all([first, second])
    with anyio.fail_after(PROMPT):
        infos.append(await late_join)
    assert sorted(i.rank for i in infos) == [0, 1, 2]
    assert {i.world_size for i in infos} == {3}
    assert not (await observer()).wait_list


async def test_num_nodes_waiting_returns_the_length_of_the_wait_list(
    nodes: NodeFactory, observer: Observer
) -> None:
    """DynamicRendezvousHandlerTest.test_num_nodes_waiting_returns_expected_value."""
    (member,) = await nodes(1, 1, 3, last_call_timeout=0.1)
    late = await nodes(2, 1, 3, last_call_timeout=0.1)
    assert await member.num_nodes_waiting() == 0
    await join_all([member])
    joins = [asyncio.ensure_future(node.next_rendezvous()) for node in late]

    async def both_waiting() -> bool:
        return len((await observer()).wait_list) == 2

    await until(both_waiting)
    for node in (member, *late):
        assert await node.num_nodes_waiting() == 2
    await join_all([member])
    with anyio.fail_after(PROMPT):
        await asyncio.gather(*joins)


async def test_redundancy_list(nodes: NodeFactory, observer: Observer) -> None:
    """IntegrationTest.test_redundancy_list and TestRendezvousJoinOp.test_treat_as_
    redundancy_for_next_rendezvous_if_rendezvous_is_complete: a node arriving at a complete,
    full round is listed as redundant, not as waiting."""
    first, second, extra = await nodes(3, 2, 2)
    await join_all([first, second])
    extra_join = asyncio.ensure_future(extra.next_rendezvous())

    async def redundant() -> bool:
        return [m.node for m in (await observer()).redundancy_list] == [extra.node]

    await until(redundant)
    assert not (await observer()).wait_list
    assert await first.num_nodes_waiting() == 0
    extra_join.cancel()
    await asyncio.gather(extra_join, return_exceptions=True)


@ASYNC_ONLY
async def test_redundancy_transition_to_wait_list_then_join_rendezvous(
    nodes: NodeFactory, observer: Observer
) -> None:
    """IntegrationTest.test_redundancy_transition_to_wait_list_then_join_rendezvous and
    TestRendezvousJoinOp.test_remove_from_rednundancy_list: a member dies (its heartbeats
    stop); the redundant node moves to the wait list and joins the next round."""
    survivor, victim, extra = await nodes(3, 1, 2, **SHORT_BEATS, last_call_timeout=0.1)
    await join_all([survivor, victim])
    extra_join = asyncio.ensure_future(extra.next_rendezvous())

    async def redundant() -> bool:
        return len((await observer()).redundancy_list) == 1

    await until(redundant)
    await victim.die()

    async def moved() -> bool:
        state = await observer()
        return len(state.participants) == 1 and [m.node for m in state.wait_list] == [extra.node]

    await until(moved)
    assert await survivor.num_nodes_waiting() == 1
    (info,) = await join_all([survivor])
    with anyio.fail_after(PROMPT):
        extra_info = await extra_join
    assert {info.rank, extra_info.rank} == {0, 1} and info.world_size == 2


@ASYNC_ONLY
async def test_no_timeout_for_redundant_node(nodes: NodeFactory, observer: Observer) -> None:
    """TestRendezvousJoinOp.test_no_timeout_for_redundant_node and test_keep_alive_for_
    redundant_node: a redundant node outlives its join timeout and the heartbeat window,
    waiting as torch's does (a keep-alive per interval, not a request loop); when the run
    closes it exits gracefully."""
    (member,) = await nodes(1, 1, 1, **SHORT_BEATS)
    (extra,) = await nodes(1, 1, 1, **SHORT_BEATS, join_timeout=0.3)
    await join_all([member])
    extra_join = asyncio.ensure_future(extra.next_rendezvous())

    async def redundant() -> bool:
        return len((await observer()).redundancy_list) == 1

    await until(redundant)
    await anyio.sleep(0.4)  # past its join timeout
    asked = extra.handler.stats.requests
    await anyio.sleep(0.4)  # and past the heartbeat window
    asked = extra.handler.stats.requests - asked
    assert not extra_join.done(), extra_join
    assert [m.node for m in (await observer()).redundancy_list] == [extra.node]
    assert asked <= 20, f"{asked} requests in 0.4 s while standing by"
    await member.set_closed()
    with anyio.fail_after(PROMPT), pytest.raises(RendezvousGracefulExitError):
        await extra_join


async def test_member_leaving_a_complete_round_waits_for_the_next_one(
    nodes: NodeFactory, observer: Observer
) -> None:
    """test_run_removes_from_participants (a complete round stays complete) then
    TestRendezvousJoinOp's wait list: a member calling ``next_rendezvous`` again leaves its
    round and waits; the other member sees a node waiting and joins it in the next round."""
    first, second = await nodes(2, 1, 2, last_call_timeout=0.1)
    await join_all([first, second])
    round_ = (await observer()).status.round
    again = asyncio.ensure_future(first.next_rendezvous())

    async def first_waits() -> bool:
        return await second.num_nodes_waiting() == 1

    await until(first_waits)
    state = await observer()
    assert state.status.complete and state.status.round == round_
    assert [m.node for m in state.participants] == [second.node]
    (info,) = await join_all([second])
    with anyio.fail_after(PROMPT):
        first_info = await again
    assert {info.rank, first_info.rank} == {0, 1}
    assert (await observer()).status.round == round_ + 1


@ASYNC_ONLY
async def test_participant_leaving_below_min_nodes_clears_the_last_call(
    nodes: NodeFactory, observer: Observer
) -> None:
    """test_run_removes_from_participants_and_clears_last_call_if_rendezvous_has_less_than_
    min_nodes, TestRendezvousJoinOp.test_removes_from_participants_if_timed_out_but_rollback_
    deadline_is_not_reached: the third node's join times out; the last call its arrival
    started is cleared, so the two left never complete below min nodes."""
    pair = await nodes(2, 3, 4, last_call_timeout=0.5)
    (brief,) = await nodes(1, 3, 4, last_call_timeout=0.5, join_timeout=0.2)
    joins = [asyncio.ensure_future(node.next_rendezvous()) for node in pair]

    async def two_listed() -> bool:
        return (await observer()).status.participants == 2

    await until(two_listed)
    with anyio.fail_after(PROMPT), pytest.raises(RendezvousTimeoutError):
        await brief.next_rendezvous()
    status = (await observer()).status
    assert status.participants == 2 and status.deadline_ms is None
    await anyio.sleep(0.5)  # the cleared last call would have ended by now
    assert not (await observer()).status.complete
    assert not any(join.done() for join in joins)
    (third,) = await nodes(1, 3, 4, last_call_timeout=0.5)
    infos = await join_all([third])
    with anyio.fail_after(PROMPT):
        infos += await asyncio.gather(*joins)
    assert sorted(i.rank for i in infos) == [0, 1, 2]


@ASYNC_ONLY
async def test_join_timeout_removes_the_node_from_the_wait_list(
    nodes: NodeFactory, observer: Observer
) -> None:
    """TestRendezvousJoinOp.test_raises_timeout_if_rollback_deadline_exceeded_and_node_is_in_
    wait_list and test_removes_from_wait_list_if_timed_out_but_rollback_deadline_is_not_
    reached: a latecomer whose join times out leaves the wait list."""
    (member,) = await nodes(1, 1, 2, last_call_timeout=0.1)
    (late,) = await nodes(1, 1, 2, last_call_timeout=0.1, join_timeout=0.4)
    await join_all([member])
    with anyio.fail_after(PROMPT), pytest.raises(RendezvousTimeoutError):
        await late.next_rendezvous()
    state = await observer()
    assert not state.wait_list and not state.knows(late.node)
    assert await member.num_nodes_waiting() == 0


@ASYNC_ONLY
async def test_keep_alive_updates_last_heartbeat(nodes: NodeFactory, observer: Observer) -> None:
    """DynamicRendezvousHandlerTest.test_keep_alive_updates_last_heartbeat and
    TestRendezvousKeepAliveOp.test_updates_keep_alive_if_needed: a member's heartbeat time
    moves on with its keep-alives, and it outlives many heartbeat windows."""
    group = await nodes(2, 2, 2, **SHORT_BEATS)
    await join_all(group)
    first = {m.node: m.beat_ms for m in (await observer()).participants}
    await anyio.sleep(0.9)  # two heartbeat windows
    later = {m.node: m.beat_ms for m in (await observer()).participants}
    assert set(later) == {node.node for node in group}
    assert all(later[n] > first[n] for n in first), (first, later)


@ASYNC_ONLY
async def test_a_member_whose_heartbeats_stop_is_removed(
    nodes: NodeFactory, observer: Observer
) -> None:
    """BackendRendezvousStateHolderTest.test_sync_sanitizes_state: a node silent for the
    heartbeat window is dropped from the participants (and the others can go on)."""
    survivor, victim = await nodes(2, 1, 2, **SHORT_BEATS, last_call_timeout=0.1)
    await join_all([survivor, victim])
    await victim.die()

    async def dropped() -> bool:
        return not (await observer()).knows(victim.node)

    await until(dropped)
    (info,) = await join_all([survivor])
    assert (info.rank, info.world_size) == (0, 1)


@ASYNC_ONLY
async def test_the_sole_member_silent_leaves_the_run_to_a_new_round(
    nodes: NodeFactory, observer: Observer
) -> None:
    """BackendRendezvousStateHolderTest.test_sync_sanitizes_state_if_no_participants_is_left:
    once the only participant is silent for the heartbeat window, a new node is not held up
    by it: it forms the next round alone."""
    (alone,) = await nodes(1, 1, 1, **SHORT_BEATS)
    await join_all([alone])
    round_ = (await observer()).status.round
    await alone.die()
    await anyio.sleep(0.5)  # the heartbeat window (0.4 s) has passed
    (again,) = await nodes(1, 1, 1, **SHORT_BEATS)
    (info,) = await join_all([again])
    assert (info.rank, info.world_size) == (0, 1)
    state = await observer()
    assert state.status.round > round_ and [m.node for m in state.participants] == [again.node]
