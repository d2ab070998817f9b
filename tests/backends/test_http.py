"""The HTTP backend against a real aelastic HTTP server (a subprocess, or in this loop)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import stat
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import pytest
from aiohttp import web

from aelastic import (
    RendezvousConnectionError,
    RendezvousParameters,
    RendezvousStateError,
)
from aelastic.backends import _shared
from aelastic.backends._engine import now_ms
from aelastic.backends.http.client import HttpBackend, create_backend, parse_endpoint
from aelastic.backends.http.server import PersistenceError, _runs, create_app
from aelastic.backends.http.server._runs import RunStore
from aelastic.core.params import Rules
from aelastic.core.state import FORMAT, NodeDesc, Op, Outcome, Request, Snapshot, Transition
from aelastic.core.token import NO_STATE, is_valid, make, parse
from aelastic.core.wire import (
    reply_from_json,
    request_to_json,
    rules_to_json,
    snapshot_from_json,
    snapshot_to_json,
    status_from_json,
)
from aelastic.rendezvous import DynamicRendezvousHandler, create_handler
from tests._http_server import HttpServer, free_port, serve_in_loop
from tests._rendezvous_helpers import PROMPT, SECRET, assert_one_group, handler_group, join_all
from tests.cli._proc import signals_as

pytestmark = pytest.mark.anyio

TOKEN = "s3cret-token"
RULES = Rules(2, 3, last_call_ms=60_000, window_ms=60_000)
ROOT = Path(__file__).resolve().parents[2]
HEADER = b'{"format": "aelastic.http.runs", "version": 4}\n'


@pytest.fixture(scope="module")
def server() -> Iterator[HttpServer]:
    with HttpServer() as srv:
        yield srv


@pytest.fixture
def token_server() -> Iterator[HttpServer]:
    """A server with a token, of this test alone (wrong tokens sent by one test must not
    make the next one wait: failed checks are limited per client)."""
    with HttpServer(token=TOKEN) as srv:
        yield srv


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[HttpServer]:
    """A server of this test alone, keeping its runs in a journal (restart tests)."""
    srv = HttpServer(persist=tmp_path / "runs.json")
    try:
        yield srv
    finally:
        srv.close()


@asynccontextmanager
async def backend(url: str, run_id: str, **kwargs: Any) -> AsyncIterator[HttpBackend]:
    b = HttpBackend(run_id, url, **kwargs)
    try:
        yield b
    finally:
        await b.aclose()


def group(
    url: str, run_id: str, count: int, min_nodes: int, max_nodes: int, **conf: Any
) -> AbstractAsyncContextManager[list[DynamicRendezvousHandler]]:
    return handler_group("http", url, run_id, count, min_nodes, max_nodes, **conf)


def node(index: int) -> NodeDesc:
    return NodeDesc("10.9.8.7", 4000 + index, 0)


def request(op: Op, index: int = 0, rules: Rules = RULES, **flags: Any) -> Request:
    return Request(op, node(index), rules, secret=SECRET, **flags)


def body(op: Op, index: int = 0, rules: Rules = RULES, **flags: Any) -> dict[str, Any]:
    """A rendezvous request's JSON form (what ``POST .../rendezvous`` takes)."""
    return request_to_json(request(op, index, rules, **flags))


async def raw(
    method: str,
    url: str,
    json_body: Any = None,
    *,
    data: bytes | None = None,
    token: str | None = None,
    params: dict[str, str] | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, Any]]:
    """One request with a fresh session (another process, in effect): (status, JSON answer)."""
    sent = dict(headers or {})
    if token:
        sent["Authorization"] = f"Bearer {token}"
    async with aiohttp.ClientSession() as session:
        kwargs: dict[str, Any] = {"data": data} if data is not None else {"json": json_body}
        async with session.request(method, url, headers=sent, params=params, **kwargs) as resp:
            return resp.status, await resp.json(content_type=None)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def without_time(snapshot: Snapshot | None) -> Any:
    """A snapshot's JSON form without the time it was made (for comparisons)."""
    if snapshot is None:
        return None
    doc = snapshot_to_json(snapshot)
    del doc["status"]["now"]
    return doc


async def until_known(b: HttpBackend, count: int) -> Snapshot:
    """The run's snapshot once it lists ``count`` nodes (joins to an open round notify
    nobody, so this asks)."""
    with anyio.fail_after(PROMPT):
        while True:
            snapshot = await b.snapshot()
            if snapshot is not None and len(snapshot.members()) == count:
                return snapshot
            await asyncio.sleep(0.02)


# -- a server in this loop whose requests are counted ---------------------------------------


@dataclass
class Traffic:
    """What an in-loop server was asked, by ``"METHOD last-path-segment"`` (a long-poll of
    the status is ``"GET status?wait"``, a held keep-alive ``"POST rendezvous?seen"``): how
    many so far, how many in flight."""

    seen: Counter[str] = field(default_factory=Counter)
    in_flight: Counter[str] = field(default_factory=Counter)
    moved: asyncio.Event = field(default_factory=asyncio.Event)

    async def until(self, predicate: Callable[[], bool]) -> None:
        with anyio.fail_after(PROMPT):
            while not predicate():
                self.moved.clear()
                await self.moved.wait()


@asynccontextmanager
async def counted_server(**kwargs: Any) -> AsyncIterator[tuple[str, Traffic]]:
    """The server's app mounted in an app that counts its requests; yields (url, traffic)."""
    traffic = Traffic()

    @web.middleware
    async def count(request: web.Request, handler: Any) -> web.StreamResponse:
        kind = f"{request.method} {request.path.rsplit('/', 1)[-1]}"
        if "wait" in request.query:
            kind += "?wait"
        if "seen" in request.query:
            kind += "?seen"  # a held keep-alive
        traffic.seen[kind] += 1
        traffic.in_flight[kind] += 1
        traffic.moved.set()
        try:
            response: web.StreamResponse = await handler(request)
            return response
        finally:
            traffic.in_flight[kind] -= 1
            traffic.moved.set()

    parent = web.Application(middlewares=[count])
    parent.add_subapp("/rdzv/", create_app(token="", **kwargs))
    runner = web.AppRunner(parent, access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}/rdzv", traffic
    finally:
        await runner.cleanup()


# -- requests, replies, statuses, snapshots -------------------------------------------------


async def test_requests_and_replies(server: HttpServer, run_id: str) -> None:
    async with backend(server.url, run_id) as b:
        assert await b.snapshot() is None
        first = await b.apply(request(Op.JOIN, 0, port=1234))
        assert (first.outcome, first.transition) == (Outcome.WAIT, Transition.ADD_TO_PARTICIPANTS)
        assert first.known and first.status.participants == 1 and first.wake_at_ms is None
        parsed = parse(first.status.token)
        assert parsed is not None and parsed[1] == 0
        second = await b.apply(request(Op.JOIN, 1))
        assert second.status.token == make(parsed[0], 1)  # the last call started
        assert second.wake_at_ms is not None and second.wake_at_ms == second.status.deadline_ms
        third = await b.apply(request(Op.JOIN, 2))  # max_nodes: complete at once
        assert (third.outcome, third.transition) == (Outcome.FINISH, Transition.MARK_COMPLETE)
        assert (third.rank, third.master_addr, third.master_port) == (2, "10.9.8.7", 1234)
        assert third.status.complete and third.status.world == 3
        snapshot = await b.snapshot()
        assert snapshot is not None and snapshot.status.token == third.status.token
        assert snapshot.ranks() == {node(0): 0, node(1): 1, node(2): 2}
        assert (snapshot.master_addr, snapshot.master_port) == ("10.9.8.7", 1234)
        again = await b.apply(request(Op.JOIN, 0))  # a member asking again: its rank
        assert (again.outcome, again.rank) == (Outcome.FINISH, 0)
        beat = await b.apply(request(Op.KEEP_ALIVE, 1))
        assert beat.transition is Transition.KEEP_ALIVE and beat.known
        assert beat.status.token == third.status.token and beat.oldest_beat_ms is not None
        left = await b.apply(request(Op.LEAVE, 2, finished=True))
        assert left.status.finished == 1 and not left.known
        assert left.status.token != third.status.token
        closed = await b.apply(request(Op.CLOSE, 0))
        assert closed.transition is Transition.MARK_CLOSED and closed.status.closed
        late = await b.apply(request(Op.JOIN, 5))
        assert late.outcome is Outcome.ERROR_CLOSED


async def test_held_keep_alive_answers_at_once_with_news_the_node_has_not_seen(
    server: HttpServer, run_id: str
) -> None:
    async with backend(server.url, run_id) as b:
        for i in range(3):  # max_nodes: complete
            done = await b.apply(request(Op.JOIN, i))
        assert done.status.complete
        seen = done.status.token
        # Held: nothing changed since the token this node knows.
        start = time.monotonic()
        beat = await b.apply(request(Op.KEEP_ALIVE, 0), hold=0.5, seen=seen)
        assert beat.status.token == seen and time.monotonic() - start >= 0.4
        await b.apply(request(Op.LEAVE, 2, finished=True))  # a change between two beats
        start = time.monotonic()
        beat = await b.apply(request(Op.KEEP_ALIVE, 0), hold=30, seen=seen)
        assert beat.status.token != seen and beat.status.finished == 1
        assert time.monotonic() - start < 10  # not held for 30 s: the news is in it
        # Without ``seen``, the status at arrival is what the node is taken to know.
        start = time.monotonic()
        beat = await b.apply(request(Op.KEEP_ALIVE, 0), hold=0.5)
        assert time.monotonic() - start >= 0.4


async def test_status_snapshot_and_delete_routes(server: HttpServer, run_id: str) -> None:
    base = f"{server.url}/v1/runs/{run_id}"
    status, doc = await raw("GET", f"{base}/status")
    assert status == 200 and status_from_json(doc).token == NO_STATE
    status, doc = await raw("GET", base)
    assert status == 404 and run_id in doc["error"]
    status, doc = await raw("POST", f"{base}/rendezvous", body(Op.JOIN, 0))
    assert status == 200
    reply = reply_from_json(doc)
    assert set(doc) >= {"outcome", "status", "transition", "rank", "known", "wake_at"}
    status, doc = await raw("GET", f"{base}/status")
    assert status == 200 and status_from_json(doc).token == reply.status.token
    status, doc = await raw("GET", base)
    assert status == 200 and snapshot_from_json(doc).knows(node(0))
    assert await raw("DELETE", base) == (200, {"deleted": True})
    assert await raw("DELETE", base) == (200, {"deleted": False})
    assert (await raw("GET", base))[0] == 404


async def test_run_ids_with_any_characters(server: HttpServer, run_id: str) -> None:
    odd = [f"{run_id}/../x", f"{run_id} ü?#%2F", ".", ".."]
    for name in odd:
        async with backend(server.url, name) as b:
            await b.reset()
            await b.apply(request(Op.JOIN, 0))
            await b.kv_set("k", name.encode())
    for name in odd:
        async with backend(server.url, name) as b:
            snapshot = await b.snapshot()
            assert snapshot is not None and snapshot.knows(node(0))
            assert await b.kv_get(["k"]) == [name.encode()]
            assert await b.reset() is True


async def test_status_long_poll_wakes_on_transitions_never_on_heartbeats(
    server: HttpServer, run_id: str
) -> None:
    base = f"{server.url}/v1/runs/{run_id}"
    joined = reply_from_json((await raw("POST", f"{base}/rendezvous", body(Op.JOIN, 0)))[1])
    current = joined.status.token
    start = time.monotonic()
    status, doc = await raw("GET", f"{base}/status", params={"token": current, "wait": "0.3"})
    assert status == 200 and doc["token"] == current  # nothing changed: held, then answered
    assert 0.25 <= time.monotonic() - start < PROMPT
    for stale in (NO_STATE, "0123abcd.7"):  # another token: answered at once
        with anyio.fail_after(PROMPT):
            _, doc = await raw("GET", f"{base}/status", params={"token": stale, "wait": "60"})
        assert doc["token"] == current
    polls = [
        asyncio.ensure_future(raw("GET", f"{base}/status", params={"token": current, "wait": "60"}))
        for _ in range(5)
    ]
    await asyncio.sleep(0.2)
    for _ in range(5):  # heartbeats answer at once and wake nobody
        status, doc = await raw("POST", f"{base}/rendezvous", body(Op.KEEP_ALIVE, 0))
        assert status == 200 and doc["transition"] == "keep_alive"
    await asyncio.sleep(0.2)
    assert not any(p.done() for p in polls)
    start = time.monotonic()
    await raw("POST", f"{base}/rendezvous", body(Op.JOIN, 1))  # the last call starts
    with anyio.fail_after(PROMPT):
        answers = await asyncio.gather(*polls)
    assert time.monotonic() - start < 2.0
    for status, doc in answers:
        assert status == 200 and doc["token"] != current and doc["deadline"] is not None


async def test_waiters_share_one_long_poll_that_heartbeats_never_wake(run_id: str) -> None:
    async with (
        counted_server() as (url, traffic),
        backend(url, run_id) as b,
        backend(url, run_id) as b2,
        backend(url, run_id, share_connections=False) as elsewhere,
    ):
        token = (await b.apply(request(Op.JOIN, 0))).status.token
        waiters = [
            asyncio.ensure_future((b if i % 2 else b2).wait_for_change(token, 60))
            for i in range(20)
        ]
        await traffic.until(lambda: traffic.in_flight["GET status?wait"] == 1)
        for _ in range(5):  # heartbeats from another node
            assert (await elsewhere.apply(request(Op.KEEP_ALIVE, 0))).known
        await asyncio.sleep(0.3)
        assert not any(w.done() for w in waiters)
        assert traffic.seen["GET status?wait"] == 1  # one long-poll, never answered
        start = time.monotonic()
        await elsewhere.apply(request(Op.JOIN, 1))  # the last call starts
        with anyio.fail_after(PROMPT):
            statuses = await asyncio.gather(*waiters)
        assert time.monotonic() - start < 2.0
        assert all(s is not None and s.deadline_ms is not None for s in statuses)
        assert traffic.seen["GET status?wait"] <= 2


async def test_wait_returns_at_once_for_a_stale_token(server: HttpServer, run_id: str) -> None:
    async with backend(server.url, run_id) as b:
        t0 = (await b.apply(request(Op.JOIN, 0))).status.token
        await b.apply(request(Op.JOIN, 1))
        with anyio.fail_after(PROMPT):
            assert await b.wait_for_change(t0, 60) is not None
            assert await b.wait_for_change(NO_STATE, 60) is not None
            assert await b.wait_for_change("other0epoch.1", 60) is not None


async def test_tokens_never_repeat_after_the_state_is_lost(server: HttpServer, run_id: str) -> None:
    async with backend(server.url, run_id) as b:
        first = (await b.apply(request(Op.JOIN, 0))).status.token
        waiter = asyncio.ensure_future(b.wait_for_change(first, 60))
        await asyncio.sleep(0.1)
        assert not waiter.done()
        assert await raw("DELETE", f"{server.url}/v1/runs/{run_id}") == (200, {"deleted": True})
        with anyio.fail_after(PROMPT):
            gone = await waiter  # the waiter learns that the state is gone
        assert gone is not None and gone.token == NO_STATE
        async with backend(f"localhost:{server.port}", run_id) as other:  # another session
            second = (await other.apply(request(Op.JOIN, 0))).status.token
        one, two = parse(first), parse(second)
        assert one is not None and two is not None and one[0] != two[0]  # a new epoch
        with anyio.fail_after(PROMPT):
            changed = await b.wait_for_change(first, 60)
        assert changed is not None and changed.token == second


async def test_a_deleted_run_wakes_its_waiters_without_busy_polling(run_id: str) -> None:
    async with (
        counted_server() as (url, traffic),
        backend(url, run_id) as b,
        backend(url, run_id, share_connections=False) as other,
    ):
        token = (await b.apply(request(Op.JOIN, 0))).status.token
        waiter = asyncio.ensure_future(b.wait_for_change(token, 60))
        await traffic.until(lambda: traffic.in_flight["GET status?wait"] == 1)
        assert await other.reset() is True
        with anyio.fail_after(PROMPT):
            gone = await waiter
        assert gone is not None and gone.token == NO_STATE
        waiter = asyncio.ensure_future(b.wait_for_change(NO_STATE, 60))
        await asyncio.sleep(0.3)
        assert not waiter.done()
        assert traffic.seen["GET status?wait"] <= 4  # held, not asked again and again
        created = (await other.apply(request(Op.JOIN, 0))).status.token
        with anyio.fail_after(PROMPT):
            news = await waiter
        assert news is not None and news.token == created


async def test_backends_of_one_loop_share_one_session(server: HttpServer, run_id: str) -> None:
    loop = asyncio.get_running_loop()
    before = set(_shared._clients.get(loop, {}))
    backends = [HttpBackend(f"{run_id}-{i % 3}", server.url) for i in range(10)]
    try:
        await asyncio.gather(*(b.snapshot() for b in backends))
        (key,) = set(_shared._clients[loop]) - before
        conn, users = _shared._clients[loop][key]
        assert users == 10
        assert all(b._conn is conn for b in backends)
        assert sorted(n for _, n in conn.feeds.values()) == [3, 3, 4]  # one feed per run
    finally:
        for b in backends:
            await b.aclose()
    assert set(_shared._clients.get(loop, {})) == before


# -- held joins -----------------------------------------------------------------------------


async def test_a_held_join_is_one_request_per_node(run_id: str) -> None:
    conf = {"keep_alive_interval": 30, "channel": False}  # over HTTP (the channel's: elsewhere)
    async with counted_server() as (url, traffic):
        async with group(url, run_id, 3, 3, 3, **conf) as nodes:
            assert_one_group(await join_all(nodes), 3)
            assert [h.stats.requests for h in nodes] == [1, 1, 1]
        # The joins (each member's first heartbeat, held, is "?seen").
        assert traffic.seen["POST rendezvous"] == 3
        before = traffic.seen["POST rendezvous"]
        # With a last call: the server asks again for the node when it ends.
        async with group(url, run_id + "-lc", 2, 2, 3, last_call_timeout=0.3, **conf) as nodes:
            assert_one_group(await join_all(nodes), 2)
            assert [h.stats.requests for h in nodes] == [1, 1]
        assert traffic.seen["POST rendezvous"] - before == 2


async def test_a_held_join_whose_node_left_is_not_joined_again(
    server: HttpServer, run_id: str
) -> None:
    base = f"{server.url}/v1/runs/{run_id}"
    held = asyncio.ensure_future(
        raw("POST", f"{base}/rendezvous", body(Op.JOIN, 0), params={"hold": "60"})
    )
    async with backend(server.url, run_id) as b:
        await until_known(b, 1)
        left = await b.apply(request(Op.LEAVE, 0))  # the node left; its join is still held
        assert not left.known and not held.done()
        await b.apply(request(Op.JOIN, 1))
        await b.apply(request(Op.JOIN, 2))  # the last call starts: the held join wakes
        with anyio.fail_after(PROMPT):
            status, doc = await held
        assert status == 200 and reply_from_json(doc).outcome is Outcome.WAIT
        snapshot = await b.snapshot()
        assert snapshot is not None and not snapshot.knows(node(0))
        assert set(snapshot.ranks()) == {node(1), node(2)}


async def test_a_cancelled_held_join_is_never_joined_again(run_id: str) -> None:
    async with (
        counted_server() as (url, traffic),
        group(url, run_id, 3, 2, 2, channel=False) as nodes,
    ):
        gone, first, second = nodes
        join = asyncio.ensure_future(gone.next_rendezvous())
        await traffic.until(lambda: traffic.in_flight["POST rendezvous"] == 1)  # held
        join.cancel()
        await asyncio.gather(join, return_exceptions=True)  # it left on its way out
        snapshot = await first.backend.snapshot()
        assert snapshot is not None and not snapshot.knows(gone.node)
        assert_one_group(await join_all([first, second]), 2)  # a transition: held joins wake
        await traffic.until(lambda: traffic.in_flight["POST rendezvous"] == 0)
        snapshot = await first.backend.snapshot()
        assert snapshot is not None and not snapshot.knows(gone.node)
        assert set(snapshot.ranks()) == {first.node, second.node}


# -- nodes and servers of the first state format --------------------------------------------


async def test_a_node_of_the_first_format_reads_a_state_naming_both_versions(
    server: HttpServer, run_id: str
) -> None:
    """What a format-1 node finds at its route (``/state``, base64 in ``state``): a state
    document of this version, which its decoder refuses naming both versions; nothing
    changes. Its rendezvous requests (format 2: no node secret) are refused naming the
    versions too."""
    base = f"{server.url}/v1/runs/{run_id}"
    async with backend(server.url, run_id) as b:
        await b.apply(request(Op.JOIN, 0))
        before = without_time(await b.snapshot())
        for method, sent, expected in [
            ("GET", None, 200),
            ("PUT", {"state": b64(b'{"format": "x"}'), "token": ""}, 409),  # a write: refused
        ]:
            status, doc = await raw(method, f"{base}/state", sent)
            assert status == expected
            assert json.loads(base64.b64decode(doc["state"])) == {"format": FORMAT, "version": 4}
            assert doc["token"] and is_valid(doc["token"])
        old = {k: v for k, v in request_to_json(request(Op.JOIN, 1)).items() if k != "secret"}
        status, doc = await raw("POST", f"{base}/rendezvous", old)
        assert status == 400 and "older aelastic" in doc["error"]
        assert without_time(await b.snapshot()) == before
    status, _ = await raw("GET", f"{server.url}/v1/runs/{run_id}-never/state")
    assert status == 200
    assert (await raw("GET", f"{server.url}/v1/runs/{run_id}-never"))[0] == 404  # not created


async def test_a_server_without_the_rendezvous_route_is_named_older(run_id: str) -> None:
    async def not_found(request: web.Request) -> web.Response:  # as an older aelastic serve
        return web.json_response({"error": "Not Found"}, status=404)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", not_found)
    async with serve_app(app) as url:
        async with backend(url, run_id, read_timeout=2.0) as b:
            with pytest.raises(RendezvousStateError, match=r"format 4 \(an older aelastic serve"):
                await b.apply(request(Op.JOIN, 0))
            with anyio.fail_after(PROMPT), pytest.raises(RendezvousConnectionError):
                await b.wait_for_change(NO_STATE, 60)
        async with group(url, run_id, 1, 1, 1) as (handler,):
            with anyio.fail_after(PROMPT), pytest.raises(RendezvousStateError, match="older"):
                await handler.next_rendezvous()


@asynccontextmanager
async def serve_app(app: web.Application) -> AsyncIterator[str]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


# -- auth -----------------------------------------------------------------------------------


async def test_right_token_is_accepted(token_server: HttpServer, run_id: str) -> None:
    params = RendezvousParameters("http", token_server.endpoint, run_id, 1, 1, token=TOKEN)
    b = create_backend(params)
    try:
        assert (await b.apply(request(Op.JOIN, 0))).outcome is Outcome.WAIT
    finally:
        await b.aclose()


async def test_token_from_the_environment(
    token_server: HttpServer, run_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AELASTIC_HTTP_TOKEN", TOKEN)
    async with backend(token_server.url, run_id) as b:
        assert await b.snapshot() is None


@pytest.mark.parametrize("token", [None, "wrong", TOKEN + "x", ""])
async def test_wrong_or_missing_token_is_refused_at_once(
    token_server: HttpServer, run_id: str, token: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AELASTIC_HTTP_TOKEN", raising=False)
    async with backend(token_server.url, run_id, token=token, read_timeout=60) as b:
        start = time.monotonic()
        for call in (
            b.snapshot(),
            b.apply(request(Op.JOIN, 0), hold=30),
            b.kv_get(["k"]),
            b.wait_for_change(NO_STATE, 30),
        ):
            with pytest.raises(RendezvousConnectionError, match=r"refused.*401"):
                await call
        assert time.monotonic() - start < 5.0


async def test_handler_with_wrong_token_fails_instead_of_hanging(
    token_server: HttpServer, run_id: str
) -> None:
    async with group(token_server.url, run_id, 1, 1, 1, token="nope", read_timeout=60) as g:
        with anyio.fail_after(PROMPT), pytest.raises(RendezvousConnectionError, match="401"):
            await g[0].next_rendezvous()


async def test_server_checks_every_route(token_server: HttpServer, run_id: str) -> None:
    base = f"{token_server.url}/v1"
    run = f"/runs/{run_id}"
    for method, path in [
        ("GET", "/health"),
        ("POST", f"{run}/rendezvous"),
        ("GET", f"{run}/status"),
        ("GET", run),
        ("DELETE", run),
        ("GET", f"{run}/state"),
        ("PUT", f"{run}/state"),
        ("POST", f"{run}/kv/set"),
        ("POST", f"{run}/kv/wait"),
        ("GET", "/nowhere"),
    ]:
        status, doc = await raw(method, base + path, {}, token="bad")
        assert status == 401 and "error" in doc
    assert (await raw("GET", f"{base}/health", token=TOKEN))[0] == 200


# -- faults ---------------------------------------------------------------------------------


async def test_unreachable_server_fails_within_read_timeout(run_id: str) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    async with backend(endpoint, run_id, read_timeout=1.0) as b:
        calls = [
            b.snapshot,
            lambda: b.apply(request(Op.JOIN, 0), hold=30),
            lambda: b.kv_set("k", b""),
            lambda: b.wait_for_change(NO_STATE, 30),
        ]
        # The first call retries for read_timeout; the next ones come during the same
        # outage and get what is left of it (one attempt): the budget is never renewed.
        for index, call in enumerate(calls):
            start = time.monotonic()
            with pytest.raises(RendezvousConnectionError, match=endpoint):
                await call()
            took = time.monotonic() - start
            assert 0.9 <= took < 5.0 if index == 0 else took < 0.9, (index, took)


async def test_the_retry_budget_runs_once_per_outage_and_is_whole_again_after_an_answer(
    run_id: str,
) -> None:
    with HttpServer() as server:
        async with backend(server.endpoint, run_id, read_timeout=1.0) as b:
            await b.kv_set("k", b"1")
            server.kill()
            timings = []
            for _ in range(2):  # one outage: the second call gets what is left (nothing)
                start = time.monotonic()
                with pytest.raises(RendezvousConnectionError):
                    await b.kv_get(["k"])
                timings.append(time.monotonic() - start)
            assert 0.9 <= timings[0] < 5.0 and timings[1] < 0.9, timings
            server.start()
            assert await b.kv_get(["k"]) == [None]  # answered: the outage is over
            server.kill()
            start = time.monotonic()
            with pytest.raises(RendezvousConnectionError):
                await b.kv_get(["k"])
            assert 0.9 <= time.monotonic() - start < 5.0  # a new outage, a whole budget


async def test_queued_requests_fail_together_when_the_server_is_down(run_id: str) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    backends = [HttpBackend(run_id, endpoint, read_timeout=1.0) for _ in range(20)]
    try:
        start = time.monotonic()
        results = await asyncio.gather(
            *(b.apply(request(Op.JOIN, i)) for i, b in enumerate(backends)),
            return_exceptions=True,
        )
        assert all(isinstance(r, RendezvousConnectionError) for r in results), results
        assert time.monotonic() - start < 5.0  # not 20 x read_timeout
    finally:
        for b in backends:
            await b.aclose()


async def test_waiting_nodes_fail_when_the_server_stays_down(
    own_server: HttpServer, run_id: str
) -> None:
    own_server.start()
    async with group(own_server.url, run_id, 2, 3, 3, read_timeout=1.0) as g:
        joins = [asyncio.ensure_future(h.next_rendezvous()) for h in g]
        async with backend(own_server.url, run_id) as probe:
            await until_known(probe, 2)
        await anyio.to_thread.run_sync(own_server.kill)
        with anyio.fail_after(PROMPT):
            results = await asyncio.gather(*joins, return_exceptions=True)
        assert all(isinstance(r, RendezvousConnectionError) for r in results), results


@pytest.mark.parametrize("crash", [False, True], ids=["stop", "kill"])
async def test_server_restart_mid_rendezvous(
    own_server: HttpServer, run_id: str, crash: bool
) -> None:
    own_server.start()
    async with group(own_server.url, run_id, 4, 4, 4) as g:
        joins = [asyncio.ensure_future(h.next_rendezvous()) for h in g[:3]]
        async with backend(own_server.url, run_id) as probe:
            await until_known(probe, 3)
            await anyio.to_thread.run_sync(own_server.kill if crash else own_server.stop)
            await anyio.to_thread.run_sync(own_server.start)
            joins.append(asyncio.ensure_future(g[3].next_rendezvous()))
            with anyio.fail_after(PROMPT * 2):
                infos = await asyncio.gather(*joins)
        assert_one_group(infos, 4)
        assert_one_group(await join_all(g, PROMPT * 2), 4)  # and a fresh round works


@pytest.mark.parametrize("crash", [False, True], ids=["stop", "kill"])
async def test_a_complete_round_and_its_store_survive_a_restart(
    own_server: HttpServer, run_id: str, crash: bool
) -> None:
    """Members of a complete round go on across a restart: the round, its ranks and its
    store are there; heartbeats reach the new server (a restart grants a fresh window) and
    a watcher that waited through the restart sees the next change."""
    own_server.start()
    conf = {"keep_alive_interval": 0.5, "keep_alive_max_attempt": 6}
    async with group(own_server.url, run_id, 2, 2, 2, **conf) as (stay, go):
        infos = await join_all([stay, go])
        await infos[0].store.set("hello", b"world")
        before = await stay.backend.snapshot()
        assert before is not None
        watching = asyncio.ensure_future(stay.watch())
        await anyio.to_thread.run_sync(own_server.kill if crash else own_server.stop)
        await anyio.to_thread.run_sync(own_server.start)
        async with backend(own_server.url, run_id) as probe:
            loaded = await probe.snapshot()  # every listed node: a fresh beat at the load
            assert loaded is not None and loaded.status.token == before.status.token
            fresh = max(e.beat_ms for e in loaded.participants)
            with anyio.fail_after(PROMPT):
                while True:  # every member's own heartbeat reaches the restarted server
                    after = await probe.snapshot()
                    assert after is not None and after.status.token == before.status.token
                    if all(e.beat_ms > fresh for e in after.participants):
                        break
                    await asyncio.sleep(0.1)
        assert after.ranks() == before.ranks() and after.status.complete
        assert await infos[1].store.get("hello") == b"world"
        assert not watching.done()  # nothing changed for the members
        await go.leave()
        with anyio.fail_after(PROMPT):
            seen = await watching
        assert seen.lost == {go.node}


async def test_a_restart_grants_a_fresh_heartbeat_window(
    own_server: HttpServer, run_id: str
) -> None:
    own_server.start()
    async with backend(own_server.url, run_id) as b:
        await b.apply(request(Op.JOIN, 0))
        await anyio.to_thread.run_sync(own_server.stop)
        restarted = now_ms()
        await anyio.to_thread.run_sync(own_server.start)
        snapshot = await b.snapshot()  # reading it prunes nobody
        assert snapshot is not None
        (entry,) = snapshot.participants
        assert entry.node == node(0) and entry.beat_ms >= restarted


async def test_restart_without_persistence_starts_a_new_epoch(run_id: str) -> None:
    with HttpServer() as srv:
        async with group(srv.url, run_id, 2, 2, 2) as g:
            assert_one_group(await join_all(g), 2)
            before = await g[0].backend.snapshot()
            assert before is not None
            waiter = asyncio.ensure_future(g[0].backend.wait_for_change(before.status.token, 60))
            await anyio.to_thread.run_sync(srv.stop)
            await anyio.to_thread.run_sync(srv.start)
            with anyio.fail_after(PROMPT):
                news = await waiter  # the state is gone, and its watchers learn it
            assert news is not None and news.token != before.status.token
            assert_one_group(await join_all(g, PROMPT * 2), 2)  # a fresh round forms
            after = await g[0].backend.snapshot()
            assert after is not None
            old, new = parse(before.status.token), parse(after.status.token)
            assert old is not None and new is not None and old[0] != new[0]


async def test_shutdown_does_not_wait_for_long_polls(own_server: HttpServer, run_id: str) -> None:
    own_server.start()
    base = f"{own_server.url}/v1/runs/{run_id}"
    polls = [
        raw("GET", f"{base}-idle/status", params={"token": NO_STATE, "wait": "60"}),
        raw("POST", f"{base}/rendezvous", body(Op.JOIN, 0), params={"hold": "60"}),
        raw("POST", f"{base}/kv/wait", {"keys": ["never"], "timeout": 60}),
    ]
    held = [asyncio.ensure_future(p) for p in polls]
    async with backend(own_server.url, run_id + "-b", read_timeout=2.0) as b:
        waiter = asyncio.ensure_future(b.wait_for_change(NO_STATE, 60))
        async with backend(own_server.url, run_id) as probe:
            await until_known(probe, 1)  # the held join arrived (and the others with it)
        await asyncio.sleep(0.3)
        assert not any(p.done() for p in (*held, waiter))
        start = time.monotonic()
        assert await anyio.to_thread.run_sync(own_server.stop) == 0
        assert time.monotonic() - start < 5.0
        with anyio.fail_after(PROMPT):
            (s1, _), (s2, joined), (s3, _) = await asyncio.gather(*held)
        assert (s1, s2, s3) == (503, 200, 503)
        assert reply_from_json(joined).outcome is Outcome.WAIT  # answered, not held
        with anyio.fail_after(PROMPT), pytest.raises(RendezvousConnectionError):
            await waiter


# -- the journal (--persist) ----------------------------------------------------------------


async def test_journal_lines_and_heartbeats_are_not_saved(tmp_path: Path) -> None:
    path = tmp_path / "runs.json"
    with HttpServer(persist=path) as srv:
        async with backend(srv.url, "r") as b:
            await b.apply(request(Op.JOIN, 0))
            await b.kv_set("k", b"v")
            size = path.stat().st_size
            for _ in range(5):
                await b.apply(request(Op.KEEP_ALIVE, 0))
            await b.apply(request(Op.STATUS, 0))
            assert path.stat().st_size == size  # heartbeats and reads write nothing
            await b.apply(request(Op.JOIN, 1))
            assert path.stat().st_size > size
    lines = path.read_bytes().splitlines()
    assert json.loads(lines[0]) == {"format": "aelastic.http.runs", "version": 4}
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # it holds the nodes' secrets
    records = [json.loads(line) for line in lines[1:]]
    assert {r["run"] for r in records} == {"r"}
    last = records[-1]
    assert last["kv"] == {"k": b64(b"v")}
    assert [n for n, _ in last["state"]["participants"]] == [node(0).key, node(1).key]
    assert "beats" not in last["state"]
    assert last["state"]["rules"] == rules_to_json(RULES)
    assert dict(last["state"]["secrets"]) == {node(0).key: SECRET, node(1).key: SECRET}
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]  # none left behind


async def test_last_line_wins_and_a_cut_short_last_line_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "runs.json"
    lines = [
        HEADER,
        b'{"run": "a", "state": null, "kv": {"k": "MQ=="}}\n',
        b'{"run": "gone", "state": null, "kv": {"k": "MQ=="}}\n',
        b'{"run": "a", "state": null, "kv": {"k": "Mg=="}}\n',
        b'{"run": "gone", "deleted": true}\n',
        b'{"run": "a", "state": null, "kv": {"k": "Mw',  # a crash while appending
    ]
    path.write_bytes(b"".join(lines))
    with HttpServer(persist=path) as srv:
        async with backend(srv.url, "a") as a, backend(srv.url, "gone") as gone:
            assert await a.kv_get(["k"]) == [b"2"]
            assert await gone.kv_get(["k"]) == [None]
        assert "incomplete last line" in srv.stderr
    rewritten = path.read_bytes().splitlines()
    assert len(rewritten) == 2 and json.loads(rewritten[1])["run"] == "a"  # compact at start


async def test_a_stale_temporary_file_is_removed_at_start(tmp_path: Path) -> None:
    stale = tmp_path / ".runs.json.99999.tmp"
    stale.write_bytes(b"half a rewrite")
    other = tmp_path / ".other.json.99999.tmp"
    other.write_bytes(b"not ours")
    with HttpServer(persist=tmp_path / "runs.json"):
        assert not stale.exists()
        assert other.exists()


def test_a_missing_directory_is_refused_at_start(tmp_path: Path) -> None:
    path = tmp_path / "nowhere" / "runs.json"
    done = serve_once(["--persist", str(path)])
    assert done.returncode == 2, done.stderr
    assert "aelastic serve: error:" in done.stderr and str(path) in done.stderr
    assert "does not exist" in done.stderr
    assert not path.parent.exists()


def test_a_foreign_journal_is_refused_at_start_and_left_as_it_is(tmp_path: Path) -> None:
    path = tmp_path / "runs.json"
    content = b'{"format": "aelastic.http.runs", "version": 1, "runs": {}}'  # the first format
    path.write_bytes(content)
    done = serve_once(["--persist", str(path)])
    assert done.returncode == 2, done.stderr
    assert "cannot be loaded" in done.stderr and "version 1" in done.stderr
    assert path.read_bytes() == content


def serve_once(args: list[str]) -> subprocess.CompletedProcess[str]:
    """``aelastic serve --port 0 ARGS`` that is expected to exit at once."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("AELASTIC_HTTP_TOKEN", None)
    cmd = [sys.executable, "-m", "aelastic", "serve", "--port", "0", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, cwd=ROOT)


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b"",
        b'{"format": "something else"}\n',
        b'{"format": "aelastic.http.runs", "version": 1, "runs": {}}',
        b'{"format": "aelastic.http.runs", "version": 99}\n',
        b'{"format": "aelastic.http.runs", "version": 2}\n',  # before runs had rules
        HEADER + b'{"run": "r", "state": {"epoch": "ab", "generation": 1}, "kv": {}}\n',
        HEADER + b"[1, 2]\n",
        HEADER + b'{"run": "", "state": null, "kv": {}}\n',
        HEADER + b'{"run": "r", "state": null, "kv": {"k": "!!"}}\n',
        HEADER + b'{"run": "r", "state": null, "kv": {"k": 5}}\n',
        HEADER + b'{"run": "r", "state": {"epoch": "no!", "generation": 1}, "kv": {}}\n',
        HEADER + b'{"run": "r", "state": {"epoch": "ab", "generation": -1}, "kv": {}}\n',
        HEADER + b'{"run": "r", "st\n{"run": "s", "state": null, "kv": {}}\n',  # cut, not last
    ],
)
def test_a_corrupt_journal_is_a_clear_startup_error(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "runs.json"
    path.write_bytes(content)
    with pytest.raises(PersistenceError, match=r"cannot be loaded.*left as it is"):
        RunStore(path)
    assert path.read_bytes() == content
    assert not list(tmp_path.glob(".runs.json.*"))


async def test_an_unwritable_journal_answers_503_then_recovers(tmp_path: Path, run_id: str) -> None:
    folder = tmp_path / "state"
    folder.mkdir()
    srv = HttpServer(persist=folder / "runs.json")
    try:
        srv.start()
        async with backend(srv.url, run_id, read_timeout=1.0) as b:
            await b.kv_set("before", b"1")
            await b.apply(request(Op.JOIN, 0))
            folder.rename(tmp_path / "moved")  # the server can no longer write its journal
            with pytest.raises(RendezvousConnectionError, match="could not persist"):
                await b.kv_add("n", 1)
            with pytest.raises(RendezvousConnectionError, match="could not persist"):
                await b.apply(request(Op.JOIN, 1))
            assert srv.running
            folder.mkdir()
            assert await b.kv_add("n", 1) == 2  # the first add was kept (in memory)
            await anyio.to_thread.run_sync(srv.stop)
            await anyio.to_thread.run_sync(srv.start)  # the journal written after is whole
            assert await b.kv_get(["before", "n"]) == [b"1", b"2"]
            snapshot = await b.snapshot()
            assert snapshot is not None and set(snapshot.ranks()) == {node(0), node(1)}
    finally:
        srv.close()


async def test_a_failed_append_is_followed_by_a_whole_rewrite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write cut short (a full disk) never leaves a broken line before later ones."""
    path = tmp_path / "runs.json"
    store = RunStore(path)
    store.engine.kv_set("a", "k", b"1")
    await store.durable()
    append = _runs._append

    def half(target: Path, lines: list[bytes]) -> None:
        data = b"".join(lines)
        with open(target, "ab") as f:
            f.write(data[: len(data) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_runs, "_append", half)
    store.engine.kv_set("a", "k", b"2")
    with pytest.raises(PersistenceError, match="No space left"):
        await store.durable()
    monkeypatch.setattr(_runs, "_append", append)
    store.engine.kv_set("b", "k", b"3")
    await store.durable()
    store.close()
    loaded = RunStore(path)
    assert loaded.engine.kv_get("a", ["k"]) == [b"2"]
    assert loaded.engine.kv_get("b", ["k"]) == [b"3"]


async def test_idle_runs_expire() -> None:
    store = RunStore()
    engine = store.engine
    for run in ("old", "busy", "fresh"):
        engine.kv_set(run, "k", b"v")
    engine.runs["old"].touched = engine.runs["busy"].touched = time.monotonic() - 100
    waiter = asyncio.ensure_future(engine.wait_status("busy", NO_STATE, 30))
    await asyncio.sleep(0)
    assert store.expire(50, time.monotonic()) == 1
    assert set(engine.runs) == {"busy", "fresh"}
    store.close()
    with anyio.fail_after(PROMPT):
        assert await waiter is False


# -- bad input ------------------------------------------------------------------------------


async def test_oversized_body_is_413_and_changes_nothing(run_id: str) -> None:
    async with serve_in_loop(max_body=4096) as url, backend(url, run_id) as b:
        await b.apply(request(Op.JOIN, 0))
        await b.kv_set("k", b"small")
        before = without_time(await b.snapshot())
        big = {**body(Op.JOIN, 1), "node": "x" * 8000}
        status, doc = await raw("POST", f"{url}/v1/runs/{run_id}/rendezvous", big)
        assert status == 413 and "too large" in doc["error"]
        with pytest.raises(RendezvousConnectionError, match="413"):
            await b.kv_set("k", b"y" * 8000)
        assert without_time(await b.snapshot()) == before
        assert await b.kv_get(["k"]) == [b"small"]


def _join_with(**changes: Any) -> bytes:
    doc = {**body(Op.JOIN, 7), **changes}
    return json.dumps({k: v for k, v in doc.items() if v is not ...}).encode()


JOIN = _join_with()


@pytest.mark.parametrize(
    ("method", "path", "sent"),
    [
        ("POST", "/rendezvous", b"not json"),
        ("POST", "/rendezvous", b"[]"),
        ("POST", "/rendezvous", _join_with(op="dance")),
        ("POST", "/rendezvous", _join_with(op=...)),
        ("POST", "/rendezvous", _join_with(node="no-pid")),
        ("POST", "/rendezvous", _join_with(node=5)),
        ("POST", "/rendezvous", _join_with(min=0)),
        ("POST", "/rendezvous", _join_with(min=4, max=3)),
        ("POST", "/rendezvous", _join_with(window=0)),
        ("POST", "/rendezvous", _join_with(last_call=1.5)),
        ("POST", "/rendezvous", _join_with(port=70000)),
        ("POST", "/rendezvous", _join_with(expired="yes")),
        ("POST", "/rendezvous", _join_with(extra=1)),
        ("POST", "/rendezvous?hold=-1", JOIN),
        ("POST", "/rendezvous?hold=301", JOIN),
        ("POST", "/rendezvous?hold=nan", JOIN),
        ("POST", "/rendezvous?hold=1&hold=2", JOIN),
        ("POST", "/rendezvous?hold=1&seen=not-a-token", JOIN),
        ("POST", "/rendezvous?wait=1", JOIN),
        ("GET", "/status?wait=5", b""),
        ("GET", "/status?token=x&wait=5", b""),
        ("GET", "/status?token=&wait=-1", b""),
        ("GET", "/status?token=&wait=nan", b""),
        ("GET", "/status?token=&wait=1e9", b""),
        ("GET", "/status?hold=1", b""),
        ("GET", "?x=1", b""),
        ("DELETE", "?x=1", b""),
        ("POST", "/kv/set", b'{"key": "k"}'),
        ("POST", "/kv/set", b'{"key": 3, "value": "eA=="}'),
        ("POST", "/kv/set", b'{"key": "k", "value": "!!!"}'),
        ("POST", "/kv/get", b'{"keys": []}'),
        ("POST", "/kv/get", b'{"keys": "k"}'),
        ("POST", "/kv/add", b'{"key": "n", "amount": 1.5}'),
        ("POST", "/kv/add", b'{"key": "n", "amount": true}'),
        ("POST", "/kv/add", b'{"key": "n", "amount": 99999999999999999999}'),
        ("POST", "/kv/compare_set", b'{"key": "k", "expected": 1, "desired": "eA=="}'),
        ("POST", "/kv/wait", b'{"keys": ["k"], "timeout": 301}'),
        ("POST", "/kv/wait", b'{"keys": ["k"]}'),
        ("POST", "/kv/delete", b'{"key": "k\\u0000"}'),
    ],
)
async def test_schema_errors_are_400_and_change_nothing(
    server: HttpServer, run_id: str, method: str, path: str, sent: bytes
) -> None:
    async with backend(server.url, run_id) as b:
        await b.apply(request(Op.JOIN, 0))
        await b.kv_set("k", b"v")
        await b.kv_set("n", b"1")
        before = without_time(await b.snapshot())
        status, doc = await raw(method, f"{server.url}/v1/runs/{run_id}{path}", data=sent)
        assert status == 400, doc
        assert isinstance(doc["error"], str) and doc["error"]
        assert without_time(await b.snapshot()) == before
        assert await b.kv_get(["k", "n"]) == [b"v", b"1"]


async def test_unknown_routes_and_methods(server: HttpServer) -> None:
    status, doc = await raw("GET", f"{server.url}/v2/whatever")
    assert status == 404 and doc["error"]
    for method, path in [
        ("POST", "/state"),
        ("GET", "/rendezvous"),
        ("POST", "/status"),
        ("PUT", ""),
        ("GET", "/kv/get"),
    ]:
        status, doc = await raw(method, f"{server.url}/v1/runs/x{path}", {})
        assert status == 405 and doc["error"], (method, path)


async def test_retried_writes_are_applied_once(server: HttpServer, run_id: str) -> None:
    base = f"{server.url}/v1/runs/{run_id}"
    for _ in range(3):
        status, doc = await raw(
            "POST", f"{base}/kv/add", {"key": "n", "amount": 2}, headers={"Idempotency-Key": "a1"}
        )
        assert (status, doc) == (200, {"value": 2})
    for _ in range(2):  # a retried delete answers as the first did
        answer = await raw("DELETE", base, headers={"Idempotency-Key": "d1"})
        assert answer == (200, {"deleted": True})


# -- deployment -----------------------------------------------------------------------------


async def test_app_mounted_inside_another_aiohttp_app(run_id: str) -> None:
    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="hello")

    parent = web.Application()
    parent.router.add_get("/", hello)
    parent.add_subapp("/rdzv/", create_app(token=TOKEN))
    async with (
        serve_app(parent) as url,
        group(f"{url}/rdzv", run_id, 3, 3, 3, token=TOKEN) as g,
    ):
        infos = await join_all(g)
        assert_one_group(infos, 3)
        await infos[0].store.set("hello", b"world")
        assert await infos[1].store.get("hello") == b"world"


async def test_many_handlers_in_one_process_form_one_group(server: HttpServer, run_id: str) -> None:
    async with group(server.url, run_id, 64, 64, 64) as g:
        assert_one_group(await join_all(g, 30), 64)


async def test_nodes_that_share_nothing_form_one_group(server: HttpServer, run_id: str) -> None:
    # Each handler has its own session and feed, like nodes in separate processes.
    params = RendezvousParameters(
        "http", server.url, run_id, 12, 12, local_addr="127.0.0.1", share_connections=False
    )
    handlers = [create_handler(params) for _ in range(12)]
    try:
        assert_one_group(await join_all(handlers, 30), 12)
    finally:
        for h in handlers:
            await h.aclose()


async def test_members_share_the_round_store(server: HttpServer, run_id: str) -> None:
    async with group(server.url, run_id, 3, 3, 3) as g:
        infos = await join_all(g)
        stores = [i.store for i in infos]
        await stores[0].set("hello", "world")
        assert await stores[2].get("hello", timeout=5) == b"world"
        assert sorted(await asyncio.gather(*(s.add("count", 1) for s in stores))) == [1, 2, 3]
        assert await stores[1].get("count") == b"3"


def test_endpoint_forms() -> None:
    assert str(parse_endpoint("node1:1234")) == "http://node1:1234/"
    assert str(parse_endpoint("node1")) == "http://node1:29400/"
    assert str(parse_endpoint("http://node1")) == "http://node1/"
    assert str(parse_endpoint("https://u:p@node1:8443/rdzv/")) == "https://node1:8443/rdzv"
    assert str(parse_endpoint("[::1]:8080")) == "http://[::1]:8080/"
    for bad in ("", "redis://x:1", "http://", "host:notaport", "http://h:1/?q=1"):
        with pytest.raises(ValueError):
            parse_endpoint(bad)


def test_second_server_on_a_busy_port_fails_clearly(server: HttpServer) -> None:
    done = serve_once(["--port", str(server.port)])
    assert done.returncode == 1
    assert f"cannot serve on 127.0.0.1:{server.port}" in done.stderr


def test_cli_picks_a_free_port_and_stops_on_sigint() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("AELASTIC_HTTP_TOKEN", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "aelastic", "serve", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
        preexec_fn=signals_as(),  # SIGINT at its default, whatever ours is
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("aelastic rendezvous server listening on http://127.0.0.1:")
        assert int(line.rsplit(":", 1)[1]) > 0
        proc.send_signal(2)
        assert proc.wait(30) == 0
    finally:
        proc.kill()
        proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
