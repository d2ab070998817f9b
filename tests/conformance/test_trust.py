"""One set of rules per run, and a node acting only for itself, on every backend.

The run's rules are the first join's: a node with other settings is refused naming both
values (never a livelock), and a request that names a member without its secret (another
client's) changes nothing, whatever window it carries. The operator closes a run through
the backend's ``close_run``.
"""

from __future__ import annotations

import dataclasses

import anyio
import pytest

from aelastic import RendezvousClosedError, RendezvousError
from aelastic.backends import create_backend
from aelastic.core.params import Rules
from aelastic.core.state import NodeDesc, Op, Outcome, Request, Snapshot
from aelastic.rendezvous import DynamicRendezvousHandler
from tests._rendezvous_helpers import PROMPT, handler_group, join_all

from .conftest import MakeParams

pytestmark = pytest.mark.anyio

FORGED = "f0" * 16


def _members(snapshot: Snapshot | None) -> dict[NodeDesc, int | None]:
    assert snapshot is not None
    return snapshot.ranks()


async def test_a_node_with_other_keep_alive_settings_is_refused_naming_both(
    make_params: MakeParams,
) -> None:
    first = make_params(2, 2, keep_alive_interval=1, keep_alive_max_attempt=3)
    other = make_params(2, 2, keep_alive_interval=5, keep_alive_max_attempt=3)
    async with (
        handler_group(first.backend, first.endpoint, first.run_id, 1, 2, 2, **first.config) as (a,),
        handler_group(other.backend, other.endpoint, other.run_id, 1, 2, 2, **other.config) as (b,),
    ):
        joining = anyio.create_task_group()
        async with joining:
            joining.start_soon(a.next_rendezvous)
            await _until_listed(a)
            with anyio.fail_after(PROMPT), pytest.raises(RendezvousError) as refused:
                await b.next_rendezvous()
            joining.cancel_scope.cancel()
    message = str(refused.value)
    assert "heartbeat window is 15 s (keep_alive_interval 5 x keep_alive_max_attempt 3)" in (
        message
    )
    assert f"run '{first.run_id}' was created with 3 s" in message


async def _until_listed(handler: DynamicRendezvousHandler) -> None:
    with anyio.fail_after(PROMPT):
        while True:
            snapshot = await handler.backend.snapshot()
            if snapshot is not None and snapshot.knows(handler.node):
                return
            await anyio.sleep(0.02)


async def test_forged_requests_for_members_change_nothing(make_params: MakeParams) -> None:
    """Another client names a member (without its secret) in a leave, a keep-alive, a join
    and a close, and a stranger asks with a 1 ms window: the round stays as it is."""
    params = make_params(2, 2)
    async with handler_group(
        params.backend, params.endpoint, params.run_id, 2, 2, 2, **params.config
    ) as group:
        await join_all(group)
        before = _members(await group[0].backend.snapshot())
        forger = create_backend(params)
        try:
            rules = group[0].settings.rules
            tiny = dataclasses.replace(rules, window_ms=1, min_nodes=1, max_nodes=1)
            for op in (Op.LEAVE, Op.KEEP_ALIVE, Op.JOIN, Op.CLOSE):
                request = Request(op, group[0].node, rules, secret=FORGED)
                reply = await forger.apply(request)
                assert reply.outcome is Outcome.ERROR_FORBIDDEN and not reply.known, op
            stranger = NodeDesc("10.66.6.6", 666, 0)
            for op in (Op.STATUS, Op.KEEP_ALIVE, Op.LEAVE, Op.CLOSE):
                reply = await forger.apply(Request(op, stranger, tiny, secret=FORGED))
                assert reply.pruned == 0 and not reply.status.closed, op
            refused = await forger.apply(Request(Op.JOIN, stranger, tiny, secret=FORGED))
            assert refused.outcome is Outcome.ERROR_RULES and refused.run_rules == rules
            after = await forger.snapshot()
            assert _members(after) == before
            assert after is not None and not after.status.closed and after.rules == rules
        finally:
            await forger.aclose()


async def test_the_operator_closes_a_run(make_params: MakeParams) -> None:
    params = make_params(1, 2)
    async with handler_group(
        params.backend, params.endpoint, params.run_id, 2, 1, 2, **params.config
    ) as (member, late):
        await join_all([member])
        operator = create_backend(params)
        try:
            assert await operator.close_run() is True
            assert await operator.close_run() is False  # closed already
        finally:
            await operator.aclose()
        assert await member.is_closed()
        with anyio.fail_after(PROMPT), pytest.raises(RendezvousClosedError):
            await late.next_rendezvous()


async def test_a_run_no_join_made_is_not_made_by_reading_or_closing_it(
    make_params: MakeParams,
) -> None:
    params = make_params(1, 1)
    backend = create_backend(params)
    try:
        stranger = NodeDesc("10.66.6.6", 666, 0)
        rules = Rules(1, 1, last_call_ms=1, window_ms=1)
        for op in (Op.STATUS, Op.CLOSE, Op.LEAVE):
            await backend.apply(Request(op, stranger, rules, secret=FORGED))
        assert await backend.close_run() is False
        assert await backend.snapshot() is None
    finally:
        await backend.aclose()


async def test_a_node_whose_name_is_taken_joins_under_another(make_params: MakeParams) -> None:
    """Another client listed this node's name first (a process with the same address and
    pid, or one that took the name once the run dropped the node): the node is not locked
    out, it joins under another name."""
    params = make_params(2, 2)
    async with handler_group(
        params.backend, params.endpoint, params.run_id, 1, 2, 2, **params.config
    ) as (node,):
        taken = node.node
        other = create_backend(params)
        try:
            await other.apply(Request(Op.JOIN, taken, node.settings.rules, secret=FORGED))
            with anyio.fail_after(PROMPT):
                info = await node.next_rendezvous()
        finally:
            await other.aclose()
        assert node.node != taken and node.node.addr == taken.addr
        assert info.world_size == 2
        assert set(_members(await node.backend.snapshot())) == {taken, node.node}
