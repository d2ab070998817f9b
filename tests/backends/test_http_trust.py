"""A real ``aelastic serve`` against clients that guess tokens, add nodes, or sit idle.

Raw HTTP and WebSocket requests play the clients, each from a loopback address of its
own (any 127.x.y.z reaches the server on Linux, and the server counts by address); a
client behind a proxy is played by ``X-Forwarded-For`` sent from the trusted proxy's
address. Every refusal must be clear, counted in ``/metrics`` and never slow the clients
whose token is right.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest

from aelastic.backends.http import HttpBackend
from aelastic.backends.http.server import _throttle
from aelastic.backends.http.server._throttle import BURST
from aelastic.core.params import Rules
from aelastic.core.state import NodeDesc, Op, Request
from aelastic.core.wire import request_to_json
from aelastic.web.pages import serve_pages
from tests._http_server import HttpServer, serve_in_loop
from tests._rendezvous_helpers import PROMPT, SECRET

pytestmark = pytest.mark.anyio
parser = pytest.importorskip("prometheus_client.parser")

TOKEN = "trust-t0ken"
#: Rules of a round that keeps forming (so every join is answered "wait" at once).
FORMING = Rules(min_nodes=50, max_nodes=100, last_call_ms=600_000, window_ms=600_000)


@asynccontextmanager
async def client_at(address: str, token: str | None = None) -> AsyncIterator[aiohttp.ClientSession]:
    """A session whose connections come from ``address`` (kept alive between requests)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    connector = aiohttp.TCPConnector(local_addr=(address, 0))
    async with aiohttp.ClientSession(connector=connector, headers=headers) as session:
        yield session


async def call(
    address: str,
    method: str,
    url: str,
    *,
    token: str | None = None,
    body: Any = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, Any], Any]:
    """One request on a new connection from ``address``: status, JSON body, headers."""
    async with (
        client_at(address, token) as session,
        session.request(method, url, json=body, headers=headers) as answer,
    ):
        return answer.status, await answer.json(content_type=None), answer.headers


async def scrape(url: str, token: str | None = None) -> dict[tuple[str, str], float]:
    """``/metrics``: value by (sample name, labels as text)."""
    async with client_at("127.0.0.1", token) as session, session.get(url + "/metrics") as answer:
        assert answer.status == 200
        text = await answer.text()
    return {
        (s.name, json.dumps(s.labels, sort_keys=True)): s.value
        for family in parser.text_string_to_metric_families(text)
        for s in family.samples
    }


def join(pid: int, addr: str = "10.0.0.9", op: Op = Op.JOIN) -> dict[str, Any]:
    return request_to_json(Request(op, NodeDesc(addr, pid, 0), FORMING, secret=SECRET))


# -- failed token checks ------------------------------------------------------------------


async def test_token_guesses_are_limited_per_client_counted_and_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A slow refill: the test's own pace on a loaded machine must not refill the bucket.
    monkeypatch.setattr(_throttle, "REFILL", 60.0)
    caplog.set_level(logging.WARNING, "aelastic.backends.http.server")
    async with serve_in_loop(token=TOKEN, pages=serve_pages) as url:
        health = url + "/v1/health"
        guesser = "127.0.0.2"
        # A node at the guesser's address, on a connection that showed the token already.
        async with client_at(guesser, TOKEN) as node:
            async with node.get(health) as answer:
                assert answer.status == 200
            answers = [await call(guesser, "GET", health, token=f"guess-{i}") for i in range(30)]
            statuses = [status for status, _, _ in answers]
            assert statuses[:BURST] == [401] * BURST and set(statuses[BURST:]) == {429}
            _, doc, headers = answers[-1]
            assert "too many failed token checks" in doc["error"]
            assert 1 <= int(headers["Retry-After"]) <= 60
            # The right token on a new connection from that address waits too: otherwise a
            # guess that hit would stand out from the refused ones.
            assert (await call(guesser, "GET", health, token=TOKEN))[0] == 429
            # ... but the node's connection, and every other address, are never slowed.
            for _ in range(20):
                async with node.get(health) as answer:
                    assert answer.status == 200
        assert (await call("127.0.0.3", "GET", health, token=TOKEN))[0] == 200
        assert (await call("127.0.0.3", "GET", health, token="wrong"))[0] == 401
        # The channel's upgrade, the pages' login form and their bearer header wait the same.
        async with client_at(guesser, TOKEN) as session:
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await session.ws_connect(url + "/v1/channel")
            assert refused.value.status == 429
            async with session.get(url + "/") as answer:
                assert answer.status == 429 and "Retry-After" in answer.headers
        async with client_at(guesser) as session:
            form = {"token": TOKEN, "next": ""}
            async with session.post(url + "/login", data=form) as answer:
                assert answer.status == 429 and "Retry-After" in answer.headers
                assert "Too many failed token checks" in await answer.text()
        # The login form's failures count for its client as the API's do.
        async with client_at("127.0.0.5") as session:
            for i in range(BURST):
                async with session.post(url + "/login", data={"token": f"g{i}"}) as answer:
                    assert answer.status == 401
            async with session.post(url + "/login", data={"token": TOKEN}) as answer:
                assert answer.status == 429
        samples = await scrape(url, TOKEN)
        lines_before_stop = _client_lines(caplog, "127.0.0.2")
    bearer, login = json.dumps({"kind": "bearer"}), json.dumps({"kind": "login"})
    assert samples[("aelastic_server_auth_failures_total", bearer)] == BURST + 1
    assert samples[("aelastic_server_auth_failures_total", login)] == BURST
    assert samples[("aelastic_server_auth_refused_total", bearer)] == 30 - BURST + 3
    assert samples[("aelastic_server_auth_refused_total", login)] == 2
    # At most a line a minute per client: its first failure at once, the rest later (here,
    # when the server stops), with the counts.
    assert (
        len(lines_before_stop) == 1 and "1 failed token check(s) (bearer 1)" in lines_before_stop[0]
    )
    lines = _client_lines(caplog, "127.0.0.2")
    assert len(lines) == 2, lines
    assert f"{BURST - 1} failed token check(s) (bearer {BURST - 1})" in lines[1], lines
    assert f"{30 - BURST + 3 + 1} request(s) refused" in lines[1], lines
    assert len(_client_lines(caplog, "127.0.0.3")) == 1


async def test_a_node_throttled_for_a_neighbours_guesses_waits_and_goes_on(
    monkeypatch: pytest.MonkeyPatch, run_id: str
) -> None:
    """Wrong tokens from this node's address (a neighbour behind the same NAT) make the
    server answer 429 with Retry-After: the node's client waits it out within its budget
    instead of failing the job at once."""
    monkeypatch.setattr(_throttle, "REFILL", 1.0)
    async with serve_in_loop(token=TOKEN) as url:
        for i in range(BURST + 2):
            await call("127.0.0.1", "GET", url + "/v1/health", token=f"guess-{i}")
        assert (await call("127.0.0.1", "GET", url + "/v1/health", token=TOKEN))[0] == 429
        client = HttpBackend(run_id, url, token=TOKEN, read_timeout=60.0)
        try:
            started = time.monotonic()
            await client.snapshot()
            assert time.monotonic() - started >= 0.5  # it waited (Retry-After: 1 s)
        finally:
            await client.aclose()


def _client_lines(caplog: pytest.LogCaptureFixture, address: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if f"client {address}:" in r.getMessage()]


async def test_many_nodes_behind_one_address_with_the_right_token_are_never_limited() -> None:
    with HttpServer(token=TOKEN) as server:

        async def node(i: int) -> list[int]:
            async with client_at("127.0.0.4", TOKEN) as session:  # a connection each
                statuses = []
                for _ in range(4):
                    async with session.get(server.url + "/v1/health") as answer:
                        statuses.append(answer.status)
                return statuses

        results = await asyncio.gather(*(node(i) for i in range(100)))
        assert {s for statuses in results for s in statuses} == {200}
        samples = await scrape(server.url, TOKEN)
    refused = [
        v for (name, _), v in samples.items() if name == "aelastic_server_auth_refused_total"
    ]
    assert refused and sum(refused) == 0


# -- nodes per client ---------------------------------------------------------------------


async def test_the_nodes_one_client_adds_are_bounded(run_id: str) -> None:
    args = ("--trusted-proxy", "127.0.0.1", "--max-nodes-per-client", "3")
    with HttpServer(extra_args=args) as server:
        run = f"{server.url}/v1/runs/{run_id}"
        other = f"{server.url}/v1/runs/{run_id}-other"
        behind = {"X-Forwarded-For": "10.9.8.7"}  # the proxy names the client

        async def rdzv(body: Any, where: str = run, **kwargs: Any) -> tuple[int, dict[str, Any]]:
            kwargs.setdefault("headers", behind)
            status, doc, _ = await call(
                "127.0.0.1", "POST", where + "/rendezvous", body=body, **kwargs
            )
            return status, doc

        for pid in (1, 2):
            assert (await rdzv(join(pid)))[0] == 200
        assert (await rdzv(join(3), other))[0] == 200  # counted across runs
        status, doc = await rdzv(join(4))
        assert status == 429, doc
        assert "client 10.9.8.7 has 3 nodes" in doc["error"]
        assert "--max-nodes-per-client" in doc["error"]
        # A node already there is never refused: its joins, its heartbeats.
        assert (await rdzv(join(1)))[0] == 200
        assert (await rdzv(join(1, op=Op.KEEP_ALIVE)))[0] == 200
        # Another client behind the proxy, and clients on this machine, are not limited.
        assert (await rdzv(join(5), headers={"X-Forwarded-For": "10.9.8.8"}))[0] == 200
        for pid in range(10, 20):
            assert (await rdzv(join(pid), headers={}))[0] == 200
        # The header from a peer that is not the trusted proxy is nobody's word: that
        # peer (loopback) is the client.
        spoofed = await call("127.0.0.2", "POST", run + "/rendezvous", body=join(6), headers=behind)
        assert spoofed[0] == 200
        # The same limit on the channel.
        async with (
            client_at("127.0.0.1") as session,
            session.ws_connect(server.url + "/v1/channel", headers=behind) as ws,
        ):
            await ws.send_str(json.dumps({"id": 1, "run": run_id, "request": join(7)}))
            answer = json.loads((await asyncio.wait_for(ws.receive(), PROMPT)).data)
        assert answer["id"] == 1 and answer["status"] == 429, answer
        assert "--max-nodes-per-client" in answer["error"]
        # Nodes that went free their places (counted again at most once a second).
        status, _, _ = await call("127.0.0.1", "DELETE", other)
        assert status == 200
        await asyncio.sleep(1.1)
        assert (await rdzv(join(4)))[0] == 200
        assert (await rdzv(join(8)))[0] == 429
        samples = await scrape(server.url)
        server.stop()
        log = server.stderr
    assert samples[("aelastic_server_node_quota_refused_total", "{}")] == 3
    assert "Traceback" not in log, log


# -- idle channels ------------------------------------------------------------------------


async def test_an_idle_channel_is_closed_after_the_keepalive_timeout_as_the_log_says() -> None:
    args = ("--keepalive-timeout", "1", "--max-connections", "1")
    with HttpServer(extra_args=args) as server:
        async with client_at("127.0.0.1") as session:
            ws = await session.ws_connect(server.url + "/v1/channel")
            opened = time.monotonic()
            # The one connection is held: a new one is refused, with a line saying why.
            assert (await _raw_get(server.port, send=False)).startswith(b"HTTP/1.1 503 ")
            closed = await asyncio.wait_for(ws.receive(), 1 + PROMPT)
            after = time.monotonic() - opened
            assert closed.type is aiohttp.WSMsgType.CLOSE, closed
            assert (closed.data, closed.extra) == (1000, "idle")
            assert 0.9 <= after < 1 + PROMPT
            await ws.close()
        await asyncio.sleep(0.2)
        assert (await _raw_get(server.port)).startswith(b"HTTP/1.1 200 ")  # free again
        server.stop()
        log = server.stderr
    assert "Traceback" not in log, log
    refusal = next(line for line in log.splitlines() if "refused 1 new connection" in line)
    assert "rendezvous channel idle for --keepalive-timeout is closed" in refusal, refusal


async def test_a_channel_holding_a_request_is_not_idle(run_id: str) -> None:
    with HttpServer(extra_args=("--keepalive-timeout", "1")) as server:
        async with (
            client_at("127.0.0.1") as session,
            session.ws_connect(server.url + "/v1/channel") as ws,
        ):
            held = {"id": 7, "run": run_id, "request": join(1), "hold": 3}
            await ws.send_str(json.dumps(held))
            started = time.monotonic()
            answer = await asyncio.wait_for(ws.receive(), 3 + PROMPT)
            assert answer.type is aiohttp.WSMsgType.TEXT, answer
            assert json.loads(answer.data)["reply"]["outcome"] == "wait"
            assert time.monotonic() - started >= 2.5  # held, the channel kept open
            closed = await asyncio.wait_for(ws.receive(), 1 + PROMPT)
            assert closed.type is aiohttp.WSMsgType.CLOSE and closed.extra == "idle"


async def _raw_get(port: int, send: bool = True) -> bytes:
    """What a new connection gets (``send``: after sending ``GET /v1/health``; else a
    refused connection's answer, which comes unasked) until the server closes it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        if send:
            writer.write(b"GET /v1/health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        return await asyncio.wait_for(reader.read(), PROMPT)
    finally:
        writer.close()
