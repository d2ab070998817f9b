"""A plain heartbeat costs little: a brief answer (Redis' short script path, the HTTP
channel), and on the HTTP server no task of its own while it is held."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
from aiohttp import web

from aelastic.backends.http.client import HttpBackend
from aelastic.backends.http.server import _channel as server_channel
from aelastic.backends.http.server import create_app
from aelastic.backends.redis import RedisBackend, parse_endpoint
from aelastic.core.brief import beat_key
from aelastic.core.params import Rules
from aelastic.core.state import NodeDesc, Op, Reply, Request, Transition
from tests._redis_server import RedisServer, redis_server_fixture
from tests._rendezvous_helpers import PROMPT, SECRET

pytestmark = pytest.mark.anyio

redis_server = redis_server_fixture()
RULES = Rules(2, 3, last_call_ms=60_000, window_ms=60_000)


def request(op: Op, index: int = 0, **flags: Any) -> Request:
    return Request(op, NodeDesc("10.8.8.8", 6000 + index, 0), RULES, secret=SECRET, **flags)


def plain_beat(reply: Reply, token: str) -> None:
    assert reply.known and reply.transition is Transition.KEEP_ALIVE and not reply.pruned
    assert reply.status.token == token and reply.oldest_beat_ms is not None
    assert reply.status.complete and reply.status.participants == 3


async def test_a_plain_redis_heartbeat_is_answered_in_a_few_bytes(
    redis_server: RedisServer, run_id: str
) -> None:
    b = RedisBackend(run_id, parse_endpoint(redis_server.url), share_connections=False)
    c = redis_server.client()
    try:
        for i in range(3):
            done = await b.apply(request(Op.JOIN, i))
        token = done.status.token

        def sent() -> int:
            return int(c.info("stats")["total_net_output_bytes"])

        for _ in range(3):
            first = sent()
            info_reply = sent() - first  # what one INFO's own reply adds to the count
            before = sent()
            plain_beat(await b.apply(request(Op.KEEP_ALIVE, 1)), token)
            spent = sent() - before - info_reply
            assert spent < 80, spent  # [now, oldest] (a whole reply: 300 to 430)
        # News comes in full: the token moved (a member finished).
        await b.apply(request(Op.LEAVE, 2, finished=True))
        beat = await b.apply(request(Op.KEEP_ALIVE, 1))
        assert beat.status.token != token and beat.status.finished == 1
        assert beat.status.participants == 2
        assert beat_key(beat.status) != beat_key(done.status)
    finally:
        c.close()
        await b.aclose()


@asynccontextmanager
async def http_server() -> AsyncIterator[tuple[str, list[int]]]:
    """The rendezvous server in this loop, and the sizes of its channel's answers."""
    sizes: list[int] = []
    app = create_app()
    app[server_channel.TAPS].append(lambda status, size: sizes.append(size))
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", sizes
    finally:
        await runner.cleanup()


def answering_tasks() -> list[asyncio.Task[Any]]:
    """The server's tasks answering one request each (held beats must have none)."""
    return [
        t
        for t in asyncio.all_tasks()
        if getattr(t.get_coro(), "__qualname__", "").startswith("_Channel.")
    ]


async def test_held_http_heartbeats_have_no_task_and_brief_answers(run_id: str) -> None:
    async with http_server() as (url, sizes):
        b = HttpBackend(run_id, url)
        try:
            for i in range(3):
                done = await b.apply(request(Op.JOIN, i))
            token = done.status.token
            held = [
                asyncio.ensure_future(b.apply(request(Op.KEEP_ALIVE, i), hold=0.6, seen=token))
                for i in range(3)
            ]
            await asyncio.sleep(0.3)
            assert not any(h.done() for h in held) and not answering_tasks()
            with anyio.fail_after(PROMPT):
                beats = await asyncio.gather(*held)
            for beat in beats:
                plain_beat(beat, token)
            assert max(sizes[-3:]) < 60, sizes  # {"id":..,"brief":[now,oldest]}
            # A withdrawn held beat is never answered.
            answered = len(sizes)
            gone = asyncio.ensure_future(b.apply(request(Op.KEEP_ALIVE, 0), hold=0.4, seen=token))
            await asyncio.sleep(0.2)
            gone.cancel()
            await asyncio.gather(gone, return_exceptions=True)
            await asyncio.sleep(0.5)
            assert len(sizes) == answered
            # News answers every held beat at once, in full.
            held = [
                asyncio.ensure_future(b.apply(request(Op.KEEP_ALIVE, i), hold=30, seen=token))
                for i in range(2)
            ]
            await asyncio.sleep(0.2)
            await b.apply(request(Op.LEAVE, 2, finished=True))
            with anyio.fail_after(PROMPT):
                beats = await asyncio.gather(*held)
            assert all(beat.status.finished == 1 and beat.known for beat in beats)
            assert min(sizes[-2:]) > 100
        finally:
            await b.aclose()
