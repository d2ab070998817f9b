"""The rendezvous channel: rendezvous requests (held joins and heartbeats) as messages on one
WebSocket per connection."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import anyio
import pytest
from aiohttp import WSCloseCode, WSMsgType, web

from aelastic import RendezvousConnectionError
from aelastic.backends._engine import now_ms
from aelastic.backends.http.client import HttpBackend
from aelastic.backends.http.server import _channel as server_channel
from aelastic.backends.http.server import create_app
from aelastic.core.params import Rules
from aelastic.core.state import NodeDesc, Op, Outcome, Request, Transition
from aelastic.core.wire import reply_from_json, request_to_json
from tests._http_server import HttpServer
from tests._rendezvous_helpers import PROMPT, SECRET, assert_one_group, handler_group, join_all

pytestmark = pytest.mark.anyio

RULES = Rules(2, 3, last_call_ms=60_000, window_ms=60_000)
TOKEN = "channel-token"


def node(index: int) -> NodeDesc:
    return NodeDesc("10.7.7.7", 5000 + index, 0)


def request(op: Op, index: int = 0, **flags: Any) -> Request:
    return Request(op, node(index), RULES, secret=SECRET, **flags)


@dataclass
class Seen:
    """What an in-loop server was asked: HTTP requests by ``"METHOD last-segment"``, channel
    answers by status, and the transports of the channels (to break them)."""

    http: Counter[str] = field(default_factory=Counter)
    answers: Counter[int] = field(default_factory=Counter)
    channels: list[asyncio.BaseTransport] = field(default_factory=list)


@asynccontextmanager
async def server(
    *, token: str = "", refuse_channel: int = 0, **kwargs: Any
) -> AsyncIterator[tuple[str, Seen, web.AppRunner]]:
    """The rendezvous server in this loop; ``refuse_channel`` answers the channel's opening
    with that status (404: an older server; 400: a proxy that dropped the upgrade)."""
    seen = Seen()

    @web.middleware
    async def count(request: web.Request, handler: Any) -> web.StreamResponse:
        seen.http[f"{request.method} {request.path.rsplit('/', 1)[-1]}"] += 1
        if request.path.endswith("/channel"):
            if refuse_channel:
                return web.json_response({"error": "refused"}, status=refuse_channel)
            if request.transport is not None:
                seen.channels.append(request.transport)
        response: web.StreamResponse = await handler(request)
        return response

    app = create_app(token=token, **kwargs)
    app.middlewares.insert(0, count)
    app[server_channel.TAPS].append(lambda status, size: seen.answers.update([status]))
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", seen, runner
    finally:
        await runner.cleanup()


@asynccontextmanager
async def backends(url: str, run_id: str, *kinds: dict[str, Any]) -> AsyncIterator[list[Any]]:
    made = [HttpBackend(run_id, url, **kind) for kind in kinds]
    try:
        yield made
    finally:
        for b in made:
            await b.aclose()


async def complete(b: HttpBackend) -> str:
    """Join three nodes (the maximum: the round completes at once); the round's token."""
    for i in range(3):
        done = await b.apply(request(Op.JOIN, i))
    assert done.status.complete
    return done.status.token


async def test_keep_alives_are_messages_on_one_channel_per_connection(run_id: str) -> None:
    async with (
        server() as (url, seen, _),
        backends(url, run_id, {}, {}, {"share_connections": False}) as (a, b, private),
    ):
        token = await complete(a)
        for _ in range(5):
            for i, sender in enumerate((a, b, private)):
                beat = await sender.apply(request(Op.KEEP_ALIVE, i))
                assert beat.known and beat.transition is Transition.KEEP_ALIVE
                assert beat.status.token == token and beat.oldest_beat_ms is not None
        assert seen.answers == {200: 3 + 15}  # the joins too
        assert not seen.http["POST rendezvous"]
        assert seen.http["GET channel"] == 2  # the shared connection's, and the private one's


async def test_a_held_keep_alive_on_the_channel_brings_the_news(run_id: str) -> None:
    async with server() as (url, seen, _), backends(url, run_id, {}) as (b,):
        token = await complete(b)
        start = time.monotonic()
        beat = await b.apply(request(Op.KEEP_ALIVE, 0), hold=0.5, seen=token)
        assert beat.status.token == token and time.monotonic() - start >= 0.4
        held = asyncio.ensure_future(b.apply(request(Op.KEEP_ALIVE, 0), hold=30, seen=token))
        await asyncio.sleep(0.2)
        assert not held.done()
        await b.apply(request(Op.LEAVE, 2, finished=True))  # a round transition
        with anyio.fail_after(PROMPT):
            beat = await held
        assert beat.status.token != token and beat.status.finished == 1
        # Already past what the node has seen: answered at once.
        start = time.monotonic()
        beat = await b.apply(request(Op.KEEP_ALIVE, 0), hold=30, seen=token)
        assert beat.status.finished == 1 and time.monotonic() - start < PROMPT
        assert seen.answers[200] == 3 + 4 and not seen.http["POST rendezvous"]


async def test_a_held_join_is_one_message_per_node(run_id: str) -> None:
    async with server() as (url, seen, _):
        group = handler_group("http", url, run_id, 3, 3, 3, keep_alive_interval=30)
        async with group as nodes:
            assert_one_group(await join_all(nodes), 3)
            assert [h.stats.requests for h in nodes] == [1, 1, 1]
        assert seen.answers[200] >= 3 and not seen.http["POST rendezvous"]
        assert seen.http["GET channel"] == 1  # the handlers of one loop share a connection


async def test_a_cancelled_held_join_on_the_channel_is_never_joined_again(run_id: str) -> None:
    async with server() as (url, _, _), handler_group("http", url, run_id, 3, 2, 2) as nodes:
        gone, first, second = nodes
        join = asyncio.ensure_future(gone.next_rendezvous())
        with anyio.fail_after(PROMPT):
            while True:  # joined, and held on the server
                snapshot = await first.backend.snapshot()
                if snapshot is not None and snapshot.knows(gone.node):
                    break
                await asyncio.sleep(0.02)
        join.cancel()
        await asyncio.gather(join, return_exceptions=True)  # it left on its way out
        snapshot = await first.backend.snapshot()
        assert snapshot is not None and not snapshot.knows(gone.node)
        assert_one_group(await join_all([first, second]), 2)  # a transition: held joins wake
        await asyncio.sleep(0.3)  # the held join, had it stayed, would be applied again now
        snapshot = await first.backend.snapshot()
        assert snapshot is not None and not snapshot.knows(gone.node)
        assert set(snapshot.ranks()) == {first.node, second.node}


@pytest.mark.parametrize("refused", [404, 400])
async def test_an_older_server_or_a_proxy_without_the_channel_gets_them_over_http(
    run_id: str, refused: int
) -> None:
    async with (
        server(refuse_channel=refused) as (url, seen, _),
        backends(url, run_id, {}) as (b,),
    ):
        await complete(b)
        for _ in range(5):
            assert (await b.apply(request(Op.KEEP_ALIVE, 0))).known
        assert seen.http["POST rendezvous"] == 3 + 5
        assert seen.http["GET channel"] == 1  # asked once, not at every beat
        assert not seen.answers


async def test_a_channel_lost_mid_hold_is_resent_over_http_then_reopened(run_id: str) -> None:
    async with server() as (url, seen, _), backends(url, run_id, {}) as (b,):
        token = await complete(b)
        held = asyncio.ensure_future(b.apply(request(Op.KEEP_ALIVE, 0), hold=1.0, seen=token))
        await asyncio.sleep(0.3)
        assert len(seen.channels) == 1 and not held.done()
        seen.channels[0].abort()  # the connection breaks while the beat is held
        with anyio.fail_after(PROMPT):
            beat = await held
        assert beat.known and seen.http["POST rendezvous"] == 1  # resent over HTTP
        beat = await b.apply(request(Op.KEEP_ALIVE, 0))
        assert beat.known and seen.http["GET channel"] == 2 and seen.answers[200] == 3 + 1


async def test_shutdown_answers_held_keep_alives_and_closes_channels(run_id: str) -> None:
    async with server() as (url, seen, runner), backends(url, run_id, {}) as (b,):
        token = await complete(b)
        held = asyncio.ensure_future(b.apply(request(Op.KEEP_ALIVE, 0), hold=60, seen=token))
        await asyncio.sleep(0.3)
        start = time.monotonic()
        await runner.cleanup()
        assert time.monotonic() - start < 4.0  # not the 5 s shutdown timeout
        with anyio.fail_after(PROMPT):
            beat = await held
        assert beat.known and seen.answers[200] == 3 + 1


async def test_the_channel_is_behind_the_token(run_id: str) -> None:
    async with server(token=TOKEN) as (url, seen, _):
        async with aiohttp.ClientSession() as session:
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await session.ws_connect(url + "/v1/channel")
        assert refused.value.status == 401
        async with backends(url, run_id, {"token": "wrong"}) as (wrong,):
            with pytest.raises(RendezvousConnectionError, match="401"):
                await wrong.apply(request(Op.KEEP_ALIVE, 0))
        async with backends(url, run_id, {"token": TOKEN}) as (right,):
            await complete(right)
            assert (await right.apply(request(Op.KEEP_ALIVE, 0))).known
        assert seen.answers == {200: 3 + 1}


async def exchange(ws: aiohttp.ClientWebSocketResponse, message: Any) -> dict[str, Any]:
    await ws.send_str(message if isinstance(message, str) else json.dumps(message))
    with anyio.fail_after(PROMPT):
        answer = await ws.receive()
    assert answer.type is WSMsgType.TEXT, answer
    doc: dict[str, Any] = json.loads(answer.data)
    return doc


async def closed_with(ws: aiohttp.ClientWebSocketResponse, message: str | bytes) -> int | None:
    if isinstance(message, bytes):
        await ws.send_bytes(message)
    else:
        await ws.send_str(message)
    with anyio.fail_after(PROMPT):
        answer = await ws.receive()
    assert answer.type is WSMsgType.CLOSE, answer
    return ws.close_code


async def test_bad_messages_are_refused_and_change_nothing(
    run_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    keep_alive = request_to_json(request(Op.KEEP_ALIVE, 0))
    join = request_to_json(request(Op.JOIN, 0))
    refused = [
        {"id": 1, "run": "", "request": join},
        {"id": 2, "run": run_id, "request": {"op": "fly"}},
        {"id": 3, "run": run_id, "request": join, "hold": -1},
        {"id": 4, "run": run_id, "request": join, "hold": 1e9},
        {"id": 5, "run": run_id, "request": join, "seen": "not-a-token"},
        {"id": 6, "run": run_id, "request": join, "extra": True},
        {"id": 7, "run": run_id},
        {"id": 8, "run": run_id, "request": [1, 2]},
        {"id": 9, "run": "x" * 300, "request": keep_alive},
    ]
    async with server() as (url, seen, _), aiohttp.ClientSession() as session:
        async with session.ws_connect(url + "/v1/channel") as ws:
            for message in refused:
                doc = await exchange(ws, message)
                assert doc["id"] == message["id"] and doc["status"] == 400, doc
                assert isinstance(doc["error"], str) and doc["error"]
            async with session.get(f"{url}/v1/runs/{run_id}") as response:
                assert response.status == 404  # nothing was made
            doc = await exchange(ws, {"id": 10, "run": run_id, "request": join})
            reply = reply_from_json(doc["reply"])  # the channel still works
            assert doc["id"] == 10 and reply.outcome is Outcome.WAIT and reply.known
        for broken, code in [
            ("not json", WSCloseCode.INVALID_TEXT),
            ("[1, 2]", WSCloseCode.INVALID_TEXT),
            ('{"id": -1}', WSCloseCode.INVALID_TEXT),
            ('{"id": "7"}', WSCloseCode.INVALID_TEXT),
            (b"\x00binary", WSCloseCode.UNSUPPORTED_DATA),
        ]:
            async with session.ws_connect(url + "/v1/channel") as ws:
                assert await closed_with(ws, broken) == code
        assert seen.answers[400] == len(refused)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_a_message_larger_than_a_body_closes_the_channel(run_id: str) -> None:
    async with server(max_body=4096) as (url, _, _), aiohttp.ClientSession() as session:
        message = {"id": 1, "run": run_id, "request": {"junk": "x" * 8192}}
        async with session.ws_connect(url + "/v1/channel") as ws:
            assert await closed_with(ws, json.dumps(message)) == WSCloseCode.MESSAGE_TOO_BIG
        b = HttpBackend(run_id, url)  # the server goes on
        try:
            assert (await b.apply(request(Op.JOIN, 0))).known
        finally:
            await b.aclose()


async def test_requests_held_past_the_limit_are_refused(
    run_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server_channel, "MAX_IN_FLIGHT", 2)
    async with server() as (url, _, _), aiohttp.ClientSession() as session:
        b = HttpBackend(run_id, url)
        try:
            token = await complete(b)
        finally:
            await b.aclose()
        beat = request_to_json(request(Op.KEEP_ALIVE, 0))
        async with session.ws_connect(url + "/v1/channel") as ws:
            for msg_id in (1, 2):  # held: nothing changes
                message = {"id": msg_id, "run": run_id, "request": beat, "hold": 30, "seen": token}
                await ws.send_str(json.dumps(message))
            await asyncio.sleep(0.2)
            doc = await exchange(ws, {"id": 3, "run": run_id, "request": beat})
            assert doc["id"] == 3 and doc["status"] == 503


async def test_a_server_frozen_under_its_members_never_hangs_them(run_id: str) -> None:
    """``aelastic serve`` stopped (SIGSTOP) for longer than the heartbeat window while two
    members beat on their channels, then resumed: nobody hangs; the round either survived
    (both still beat) or both see the change and form a round again."""
    conf = {"keep_alive_interval": 0.3, "heartbeat_timeout": 1.0, "last_call_timeout": 0.1}
    with HttpServer() as srv:
        async with handler_group("http", srv.url, run_id, 2, 2, 2, **conf) as nodes:
            assert_one_group(await join_all(nodes), 2)
            await asyncio.sleep(0.5)  # beating on the channel
            os.kill(srv.pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(3.0)  # the window is 0.9 s
            finally:
                os.kill(srv.pid, signal.SIGCONT)
            resumed = now_ms()

            async def change(handler: Any) -> Any:
                with contextlib.suppress(TimeoutError):
                    with anyio.fail_after(3.0):
                        return await handler.watch()
                return None

            views = await asyncio.gather(*(change(h) for h in nodes))
            if any(view is not None for view in views):
                assert_one_group(await join_all(nodes), 2)  # formed again
            with anyio.fail_after(PROMPT):
                while True:  # both members beat again
                    snapshot = await nodes[0].backend.snapshot()
                    assert snapshot is not None
                    beats = [e.beat_ms for e in snapshot.participants]
                    if len(beats) == 2 and min(beats) > resumed:
                        break
                    await asyncio.sleep(0.05)
        assert srv.running


FROZEN_CLIENT = """
import asyncio, os, signal, sys
import aiohttp

async def main():
    async with aiohttp.ClientSession() as session:
        sockets = [await session.ws_connect(sys.argv[1]) for _ in range(5)]
        print("ready", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen: never answers a close
        await asyncio.sleep(60)

asyncio.run(main())
"""


def process_state(pid: int) -> str:
    """The state letter of a process (``T``: stopped)."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


async def test_shutdown_is_not_held_up_by_frozen_clients(run_id: str) -> None:
    async with server() as (url, seen, runner):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", FROZEN_CLIENT, url + "/v1/channel",
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            assert proc.stdout is not None
            with anyio.fail_after(PROMPT):
                assert (await proc.stdout.readline()).strip() == b"ready"
                while True:
                    if process_state(proc.pid) == "T":  # frozen
                        break
                    await asyncio.sleep(0.02)
            assert seen.http["GET channel"] == 5
            start = time.monotonic()
            await runner.cleanup()  # closing the frozen clients' channels takes no time
            assert time.monotonic() - start < 4.0
        finally:
            proc.kill()
            await proc.wait()


async def test_a_withdrawn_held_join_is_never_applied_again(run_id: str) -> None:
    rules = Rules(2, 3, last_call_ms=60_000, window_ms=60_000)
    join = request_to_json(Request(Op.JOIN, node(0), rules, secret=SECRET))
    async with server() as (url, seen, _), aiohttp.ClientSession() as session:
        b = HttpBackend(run_id, url)
        try:
            async with session.ws_connect(url + "/v1/channel") as ws:
                message = {"id": 1, "run": run_id, "request": join, "hold": 30}
                await ws.send_str(json.dumps(message))
                with anyio.fail_after(PROMPT):
                    while True:  # joined, held
                        snapshot = await b.snapshot()
                        if snapshot is not None and snapshot.knows(node(0)):
                            break
                        await asyncio.sleep(0.02)
                (joined,) = snapshot.participants
                await ws.send_str(json.dumps({"id": 1, "cancel": True}))
                await asyncio.sleep(0.2)  # a later beat time would show a join applied again
                await b.apply(Request(Op.JOIN, node(1), rules, secret=SECRET))  # last call
                await asyncio.sleep(0.3)
                snapshot = await b.snapshot()
                assert snapshot is not None
                beats = {e.node: e.beat_ms for e in snapshot.participants}
                assert beats[node(0)] == joined.beat_ms  # not joined again on the change
                with pytest.raises(TimeoutError):  # and never answered
                    with anyio.fail_after(0.3):
                        await ws.receive()
        finally:
            await b.aclose()
        assert seen.answers[200] >= 1


async def test_a_cancelled_send_withdraws_its_held_join(run_id: str) -> None:
    rules = Rules(2, 3, last_call_ms=60_000, window_ms=60_000)
    async with (
        server() as (url, _, _),
        backends(url, run_id, {}, {"share_connections": False}) as (
            b,
            other,
        ),
    ):
        held = asyncio.ensure_future(
            b.apply(Request(Op.JOIN, node(0), rules, secret=SECRET), hold=30)
        )
        with anyio.fail_after(PROMPT):
            while True:
                snapshot = await other.snapshot()
                if snapshot is not None and snapshot.knows(node(0)):
                    break
                await asyncio.sleep(0.02)
        (joined,) = snapshot.participants
        held.cancel()
        await asyncio.gather(held, return_exceptions=True)
        await asyncio.sleep(0.2)
        await other.apply(Request(Op.JOIN, node(1), rules, secret=SECRET))  # last call
        await asyncio.sleep(0.3)
        snapshot = await other.snapshot()
        assert snapshot is not None
        beats = {e.node: e.beat_ms for e in snapshot.participants}
        assert beats[node(0)] == joined.beat_ms  # withdrawn: not joined again on the change
        assert (await b.apply(request(Op.KEEP_ALIVE, 0))).known  # the channel goes on


async def test_a_held_beat_brought_early_by_news_counts_as_of_its_answer(run_id: str) -> None:
    async with server() as (url, _, _), backends(url, run_id, {}, {"channel": False}) as (b, h):
        token = await complete(b)
        for sender in (b, h):  # on the channel, and as an HTTP request: the same answer
            sent = now_ms()
            held = asyncio.ensure_future(
                sender.apply(request(Op.KEEP_ALIVE, 0), hold=30, seen=token)
            )
            await asyncio.sleep(0.4)
            news = now_ms()
            # A member finished, then one left: round transitions, news for node 0.
            finished = sender is b
            left = await b.apply(request(Op.LEAVE, 2 if finished else 1, finished=finished))
            token = left.status.token
            with anyio.fail_after(PROMPT):
                beat = await held
            assert beat.known and beat.status.token == token
            snapshot = await b.snapshot()
            assert snapshot is not None
            (entry,) = [e for e in snapshot.participants if e.node == node(0)]
            assert entry.beat_ms >= news > sent + 300  # applied again when answered
