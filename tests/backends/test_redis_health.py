"""The job's control state on a real ``redis-server``, through the backend: placements in the
join answers, the exit barrier, the job's health read back exactly, kept where no store
client writes, and requests out of bounds refused with nothing changed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest

from aelastic import RendezvousError, RendezvousParameters, RendezvousStateError
from aelastic.backends.redis import RedisBackend, create_backend
from aelastic.core.health import FailureReport, NodeReport
from aelastic.core.params import Rules
from aelastic.core.state import NodeDesc, Op, Outcome, Placement, Request
from tests._redis_server import RedisServer, redis_server_fixture
from tests._rendezvous_helpers import PROMPT, SECRET, handler_group, join_all

pytestmark = pytest.mark.anyio

server = redis_server_fixture()
RULES = Rules(2, 2, last_call_ms=60_000, window_ms=60_000)


@asynccontextmanager
async def backend(url: str, run_id: str, **conf: Any) -> AsyncIterator[RedisBackend]:
    b = create_backend(RendezvousParameters("redis", url, run_id, 1, 1, **conf))
    try:
        yield b
    finally:
        await b.aclose()


async def test_joins_answer_placements_and_reports_fill_in_who_and_where(
    server: RedisServer, run_id: str
) -> None:
    async with handler_group("redis", server.url, run_id, 2, 2, 2) as handlers:
        handlers[0].set_profile("trainer", 3)
        handlers[1].set_profile("eval", 2)
        infos = await join_all(handlers)
        by_rank = sorted(zip(infos, handlers, strict=True), key=lambda p: p[0].rank)
        first, second = (h for _, h in by_rank)
        assert first.placement is not None and second.placement is not None
        assert first.placement.base == 0 and first.placement.world == 5
        assert second.placement.base == first.placement.role_world
        assert second.placement.role_base == 0
        # A time of 17 digits, a traceback with an escape and a lone surrogate (stderr).
        message = "Traceback (most recent call last):\n  \x1b[1mValueError\x1b[0m: \udcff"
        failure = FailureReport(1733475000.1234567, 4, 1, -6, message, secondary=False)
        assert await second.report(NodeReport(failure=failure))
        health = await first.health()
        assert health is not None and health.latest is not None
        root = health.latest.root
        assert (root.time, root.message, root.exitcode) == (failure.time, message, -6)
        assert (root.node, root.host, root.node_rank) == (str(second.node), "127.0.0.1", 1)
        assert health.incidents_total == 1 and health.latest.failed == 1


async def test_the_exit_barrier_wakes_the_members_once_every_member_is_done(
    server: RedisServer, run_id: str
) -> None:
    async with handler_group("redis", server.url, run_id, 2, 2, 2) as handlers:
        await join_all(handlers)
        backend = handlers[0].backend
        status = (await backend.apply(Request(Op.STATUS, handlers[0].node, RULES))).status
        assert await handlers[0].mark_done()
        assert not await handlers[0].mark_done()  # once is enough
        after = (await backend.apply(Request(Op.STATUS, handlers[0].node, RULES))).status
        assert after.done == 1 and after.token == status.token  # nobody woken yet
        waiting = asyncio.ensure_future(backend.wait_for_change(status.token, 60))
        await asyncio.sleep(0.1)
        assert await handlers[1].mark_done()
        with anyio.fail_after(PROMPT):
            woken = await waiting
        assert woken is not None and woken.all_done and woken.done == 2


async def test_the_health_is_no_store_key_and_a_store_write_changes_nothing_of_it(
    server: RedisServer, run_id: str
) -> None:
    async with handler_group("redis", server.url, run_id, 2, 2, 2) as handlers:
        infos = await join_all(handlers)
        assert await handlers[0].report(NodeReport(quarantine="flaky disk"))
        before = await handlers[1].health()
        forged = b'{"format":"aelastic.job.health/2","incidents_total":99}'
        for key in ("health", "job/health", "../health", ":health"):
            await infos[0].store.set(key, forged)
        backend = handlers[0].backend
        assert isinstance(backend, RedisBackend)
        assert not backend.keys.rendezvous[-1].startswith(backend.keys.kv(""))
        assert await handlers[1].health() == before
        assert before is not None and dict(before.quarantined) == {"127.0.0.1": "flaky disk"}


async def test_health_of_a_run_without_state_is_none(server: RedisServer, run_id: str) -> None:
    async with backend(server.url, run_id) as b:
        assert await b.health() is None


@pytest.mark.parametrize(
    "request_",
    [
        Request(Op.JOIN, NodeDesc("10.1.1.1", 1, 0), RULES, secret=SECRET, local_world_size=0),
        Request(Op.JOIN, NodeDesc("10.1.1.1", 1, 0), RULES, secret=SECRET, role="r" * 257),
        Request(Op.JOIN, NodeDesc("10.1.1.1", 1, 0), RULES, secret=SECRET, role="a\nb"),
    ],
    ids=["no workers", "a long role", "a role with a newline"],
)
async def test_a_join_out_of_bounds_is_refused_and_stores_nothing(
    server: RedisServer, run_id: str, request_: Request
) -> None:
    async with backend(server.url, run_id) as b:
        with pytest.raises(RendezvousError, match=r"refused join.*nothing was changed"):
            await b.apply(request_)
        assert await b.snapshot() is None


async def test_a_report_out_of_bounds_is_refused_and_changes_nothing(
    server: RedisServer, run_id: str
) -> None:
    async with backend(server.url, run_id) as b:
        node = NodeDesc("10.1.1.1", 1, 0)
        joined = await b.apply(Request(Op.JOIN, node, Rules(1, 1, 1, 60_000), secret=SECRET))
        assert joined.outcome is Outcome.FINISH and joined.placement == Placement(0, 1, 0, 1)
        huge = FailureReport(1.0, 1 << 40, 0, 1, "boom")
        with pytest.raises(RendezvousError, match=r"refused report.*32-bit"):
            await b.apply(Request(Op.REPORT, node, RULES, secret=SECRET, report=NodeReport(huge)))
        health = await b.health()
        assert health is not None and not health.incidents


async def test_a_foreign_health_key_is_a_clear_error_and_left_as_it_is(
    server: RedisServer, run_id: str
) -> None:
    async with backend(server.url, run_id) as b:
        node = NodeDesc("10.1.1.1", 1, 0)
        await b.apply(Request(Op.JOIN, node, Rules(1, 1, 1, 60_000), secret=SECRET))
        health_key = b.keys.rendezvous[-1]
        with server.client() as client:
            client.hset(health_key, mapping={"incidents": "not json", "total": "1"})
        with pytest.raises(RendezvousStateError, match="job's health"):
            await b.health()
        with server.client() as client:
            client.delete(health_key)
            client.set(health_key, "a string")
            before = client.dump(health_key)
        with pytest.raises(RendezvousStateError, match="is a Redis string"):
            await b.health()
        report = NodeReport(quarantine="flaky")
        with pytest.raises(RendezvousStateError, match="is a Redis string"):
            await b.apply(Request(Op.REPORT, node, RULES, secret=SECRET, report=report))
        with server.client() as client:
            assert client.dump(health_key) == before
