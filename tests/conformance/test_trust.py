"""One set of rules per run, and a node acting only for itself, on every backend.

The run's rules are the first join's: a node with other settings is refused naming both
values (never a livelock), and a request that names a member without its secret (another
client's: its leave, keep-alive, join, failure report or "done") changes nothing, whatever
window it carries; a stranger's report or "done" changes nothing either. Closing is a
run-level act (torch's): any handler closes a run, and the operator through the backend's
``close_run``.
"""

from __future__ import annotations

import dataclasses

import anyio
import pytest

from aelastic import RendezvousClosedError, RendezvousError
from aelastic.backends import create_backend
from aelastic.core.health import FailureReport, NodeReport
from aelastic.core.params import Rules
from aelastic.core.state import NodeDesc, Op, Outcome, Request, Snapshot
from aelastic.rendezvous import DynamicRendezvousHandler
from tests._rendezvous_helpers import PROMPT, handler_group, join_all

from .conftest import MakeParams

pytestmark = pytest.mark.anyio

FORGED = "f0" * 16
_FAILURE = NodeReport(
    failure=FailureReport(time=1.0, rank=0, local_rank=0, exitcode=1, message="x")
)
_QUARANTINE = NodeReport(quarantine="forged")


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
            for op in (Op.LEAVE, Op.KEEP_ALIVE, Op.JOIN, Op.REPORT, Op.DONE):
                report = _QUARANTINE if op is Op.REPORT else None
                request = Request(op, group[0].node, rules, secret=FORGED, report=report)
                reply = await forger.apply(request)
                assert reply.outcome is Outcome.ERROR_FORBIDDEN and not reply.known, op
            stranger = NodeDesc("10.66.6.6", 666, 0)
            for op in (Op.STATUS, Op.KEEP_ALIVE, Op.LEAVE, Op.REPORT, Op.DONE):
                report = _FAILURE if op is Op.REPORT else None
                request = Request(op, stranger, tiny, secret=FORGED, report=report)
                reply = await forger.apply(request)
                assert reply.pruned == 0 and not reply.status.closed, op
            refused = await forger.apply(Request(Op.JOIN, stranger, tiny, secret=FORGED))
            assert refused.outcome is Outcome.ERROR_RULES and refused.run_rules == rules
            after = await forger.snapshot()
            assert _members(after) == before
            assert after is not None and not after.status.closed and after.rules == rules
            assert after.status.done == 0
            health = await forger.health()
            assert health is not None and not health.incidents and not health.quarantined
        finally:
            await forger.aclose()


async def test_any_handler_closes_the_run_for_every_handler(make_params: MakeParams) -> None:
    """torch's close: a handler that never joined closes the run; every handler sees it
    closed; a node waiting for its round is released with ``RendezvousClosedError``; a
    second ``set_closed()`` or ``shutdown()`` returns as the first did."""
    params = make_params(2, 2)
    async with handler_group(
        params.backend, params.endpoint, params.run_id, 3, 2, 2, **params.config
    ) as (waiting, closer, other):
        async with anyio.create_task_group() as tasks:
            released = anyio.Event()

            async def wait_for_a_round() -> None:
                with pytest.raises(RendezvousClosedError):
                    await waiting.next_rendezvous()
                released.set()

            tasks.start_soon(wait_for_a_round)
            await _until_listed(waiting)
            await closer.set_closed()
            with anyio.fail_after(PROMPT):
                await released.wait()
        assert await closer.is_closed() and await other.is_closed() and await waiting.is_closed()
        await closer.set_closed()  # a second close changes nothing
        assert await closer.shutdown() is True and await closer.shutdown() is True
        with anyio.fail_after(PROMPT), pytest.raises(RendezvousClosedError):
            await closer.next_rendezvous()


async def test_the_operator_closes_a_run(make_params: MakeParams) -> None:
    params = make_params(1, 2)
    async with handler_group(
        params.backend, params.endpoint, params.run_id, 2, 1, 2, **params.config
    ) as (member, late):
        await join_all([member, late])
        operator = create_backend(params)
        try:
            assert await operator.close_run() is True
            assert await operator.close_run() is False  # closed already
        finally:
            await operator.aclose()
        assert await member.is_closed()
        with anyio.fail_after(PROMPT), pytest.raises(RendezvousClosedError):
            await late.next_rendezvous()


async def test_a_run_no_join_made_is_not_made_by_reading_it_or_the_operators_close(
    make_params: MakeParams,
) -> None:
    params = make_params(1, 1)
    backend = create_backend(params)
    try:
        stranger = NodeDesc("10.66.6.6", 666, 0)
        rules = Rules(1, 1, last_call_ms=1, window_ms=1)
        for op in (Op.STATUS, Op.LEAVE, Op.KEEP_ALIVE, Op.REPORT, Op.DONE):
            report = _FAILURE if op is Op.REPORT else None
            await backend.apply(Request(op, stranger, rules, secret=FORGED, report=report))
        assert await backend.close_run() is False
        assert await backend.snapshot() is None
    finally:
        await backend.aclose()


async def test_a_handlers_close_of_a_run_no_join_made_closes_it_for_everyone(
    make_params: MakeParams,
) -> None:
    params = make_params(2, 2)
    async with handler_group(
        params.backend, params.endpoint, params.run_id, 2, 2, 2, **params.config
    ) as (closer, other):
        await closer.set_closed()
        assert await other.is_closed()
        with anyio.fail_after(PROMPT), pytest.raises(RendezvousClosedError):
            await closer.next_rendezvous()


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
