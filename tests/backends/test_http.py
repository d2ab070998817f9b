"""The HTTP backend against a real aelastic HTTP server (a subprocess, or in this loop)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import pytest
from aelastic.rendezvous.state import decode_state
from aiohttp import web

from aelastic import RendezvousConnectionError, RendezvousParameters, RendezvousStateError
from aelastic.backends.http import _transport
from aelastic.backends.http.client import HttpBackend, create_backend, parse_endpoint
from aelastic.backends.http.server import create_app
from aelastic.rendezvous import DynamicRendezvousHandler, create_handler
from tests._http_server import HttpServer, free_port, serve_in_loop
from tests._rendezvous_helpers import handler_group

pytestmark = pytest.mark.anyio

#: Generous bound for "promptly" on a shared 2-core machine.
PROMPT = 10.0
TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def server() -> Iterator[HttpServer]:
    with HttpServer() as srv:
        yield srv


@pytest.fixture(scope="module")
def token_server() -> Iterator[HttpServer]:
    with HttpServer(token=TOKEN) as srv:
        yield srv


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[HttpServer]:
    """A server of this test alone, persisting to a file (restart tests)."""
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


async def raw(
    method: str, url: str, body: Any = None, *, data: bytes | None = None, token: str | None = None
) -> tuple[int, dict[str, Any]]:
    """One request with a fresh session: (status, JSON answer)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as session:
        kwargs: dict[str, Any] = {"data": data} if data is not None else {"json": body}
        async with session.request(method, url, headers=headers, **kwargs) as resp:
            return resp.status, await resp.json(content_type=None)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# -- the protocol ---------------------------------------------------------------------------


async def test_state_cell_compare_and_set(server: HttpServer, run_id: str) -> None:
    async with backend(server.url, run_id) as b:
        assert await b.read() == (None, "")
        written, state, token = await b.compare_and_set(b"one", "")
        assert (written, state) == (True, b"one") and token
        assert await b.read() == (b"one", token)
        assert await b.compare_and_set(b"two", "") == (False, b"one", token)
        written, state, token2 = await b.compare_and_set(b"two", token)
        assert (written, state) == (True, b"two") and token2 != token
        assert await b.compare_and_set(b"three", token) == (False, b"two", token2)


async def test_tokens_never_repeat_after_the_state_is_lost(server: HttpServer, run_id: str) -> None:
    async with backend(server.url, run_id) as b:
        _, _, first = await b.compare_and_set(b"x", "")
        assert (await raw("DELETE", f"{server.url}/v1/runs/{run_id}"))[0] == 200
        async with backend(f"localhost:{server.port}", run_id) as other:  # another session
            _, _, second = await other.compare_and_set(b"x", "")
        assert second != first
        assert (await b.compare_and_set(b"y", first))[0] is False


async def test_long_poll_wakes_promptly_and_times_out(server: HttpServer, run_id: str) -> None:
    async with backend(server.url, run_id) as b:
        _, _, token = await b.compare_and_set(b"v1", "")
        start = time.monotonic()
        await b.wait_for_change(token, 0.3)
        assert 0.25 <= time.monotonic() - start < 5.0
        waiters = [asyncio.ensure_future(b.wait_for_change(token, 30)) for _ in range(20)]
        await asyncio.sleep(0.1)
        assert not any(w.done() for w in waiters)
        # A write through the raw API (not this process's shared channel) wakes them all.
        body = {"state": b64(b"v2"), "token": token}
        start = time.monotonic()
        assert (await raw("PUT", f"{server.url}/v1/runs/{run_id}/state", body))[0] == 200
        with anyio.fail_after(PROMPT):
            await asyncio.gather(*waiters)
        assert time.monotonic() - start < 2.0


async def test_backends_of_one_loop_share_one_session(server: HttpServer, run_id: str) -> None:
    before = len(_transport._connections)
    backends = [HttpBackend(f"{run_id}-{i % 3}", server.url) for i in range(10)]
    try:
        await asyncio.gather(*(b.read() for b in backends))
        assert len(_transport._connections) == before + 1
    finally:
        for b in backends:
            await b.aclose()
    assert len(_transport._connections) == before


# -- auth -----------------------------------------------------------------------------------


async def test_right_token_is_accepted(token_server: HttpServer, run_id: str) -> None:
    params = RendezvousParameters("http", token_server.endpoint, run_id, 1, 1, token=TOKEN)
    b = create_backend(params)
    try:
        assert (await b.compare_and_set(b"x", ""))[0]
    finally:
        await b.aclose()


async def test_token_from_the_environment(
    token_server: HttpServer, run_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AELASTIC_HTTP_TOKEN", TOKEN)
    async with backend(token_server.url, run_id) as b:
        assert await b.read() == (None, "")


@pytest.mark.parametrize("token", [None, "wrong", TOKEN + "x", ""])
async def test_wrong_or_missing_token_is_refused_at_once(
    token_server: HttpServer, run_id: str, token: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AELASTIC_HTTP_TOKEN", raising=False)
    async with backend(token_server.url, run_id, token=token, read_timeout=60) as b:
        start = time.monotonic()
        for call in (b.read(), b.kv_get(["k"]), b.wait_for_change("", 30)):
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
    for method, path in [
        ("GET", "/health"),
        ("GET", f"/runs/{run_id}/state"),
        ("PUT", f"/runs/{run_id}/state"),
        ("POST", f"/runs/{run_id}/kv/set"),
        ("DELETE", f"/runs/{run_id}"),
        ("GET", "/nowhere"),
    ]:
        status, doc = await raw(method, base + path, {}, token="bad")
        assert status == 401 and "error" in doc
    assert (await raw("GET", f"{base}/health", token=TOKEN))[0] == 200


# -- faults ---------------------------------------------------------------------------------


async def test_unreachable_server_fails_within_read_timeout(run_id: str) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    async with backend(endpoint, run_id, read_timeout=1.0) as b:
        calls = [lambda: b.read(), lambda: b.compare_and_set(b"x", ""), lambda: b.kv_set("k", b"")]
        for call in calls:
            start = time.monotonic()
            with pytest.raises(RendezvousConnectionError, match=endpoint):
                await call()
            assert 0.9 <= time.monotonic() - start < 5.0


async def test_queued_writers_fail_together_when_the_server_is_down(run_id: str) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    backends = [HttpBackend(run_id, endpoint, read_timeout=1.0) for _ in range(20)]
    try:
        start = time.monotonic()
        results = await asyncio.gather(
            *(b.compare_and_set(b"x", "") for b in backends), return_exceptions=True
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
            await wait_for(probe, lambda s: len(s.participants) == 2)
        own_server.kill()
        with anyio.fail_after(PROMPT):
            results = await asyncio.gather(*joins, return_exceptions=True)
        assert all(isinstance(r, RendezvousConnectionError) for r in results), results


async def wait_for(b: HttpBackend, predicate: Any) -> None:
    with anyio.fail_after(PROMPT):
        while True:
            data, token = await b.read()
            if data is not None and predicate(decode_state(data)):
                return
            await b.wait_for_change(token, 5)


@pytest.mark.parametrize("crash", [False, True], ids=["stop", "kill"])
async def test_server_restart_mid_rendezvous(
    own_server: HttpServer, run_id: str, crash: bool
) -> None:
    own_server.start()
    async with group(own_server.url, run_id, 4, 4, 4) as g:
        joins = [asyncio.ensure_future(h.next_rendezvous()) for h in g[:3]]
        async with backend(own_server.url, run_id) as probe:
            await wait_for(probe, lambda s: len(s.participants) == 3)
            own_server.kill() if crash else own_server.stop()
            own_server.start()
            joins.append(asyncio.ensure_future(g[3].next_rendezvous()))
            with anyio.fail_after(PROMPT * 2):
                infos = await asyncio.gather(*joins)
        assert sorted(i.rank for i in infos) == [0, 1, 2, 3]
        # and a fresh round afterwards works
        with anyio.fail_after(PROMPT * 2):
            again = await asyncio.gather(*(h.next_rendezvous() for h in g))
        assert sorted(i.rank for i in again) == [0, 1, 2, 3]


async def test_restart_without_persistence_forgets_but_recovers(run_id: str) -> None:
    with HttpServer() as srv:
        async with group(srv.url, run_id, 2, 2, 2) as g:
            first = await asyncio.gather(*(h.next_rendezvous() for h in g))
            assert sorted(i.rank for i in first) == [0, 1]
            srv.stop()
            srv.start()
            with anyio.fail_after(PROMPT * 2):
                again = await asyncio.gather(*(h.next_rendezvous() for h in g))
            assert sorted(i.rank for i in again) == [0, 1]


async def test_persistence_keeps_state_and_keys_across_restarts(
    own_server: HttpServer, run_id: str
) -> None:
    own_server.start()
    async with backend(own_server.url, run_id) as b:
        _, _, token = await b.compare_and_set(b"state", "")
        await b.kv_set("k", b"v")
        assert await b.kv_add("n", 3) == 3
        own_server.kill()  # a crash: every acknowledged write must be on disk already
        own_server.start()
        assert await b.read() == (b"state", token)
        assert await b.kv_get(["k", "n"]) == [b"v", b"3"]
        written, _, token2 = await b.compare_and_set(b"next", token)
        assert written and token2 != token
        own_server.stop()
        own_server.start()
        assert await b.read() == (b"next", token2)


async def test_corrupt_persistence_file_is_a_clear_startup_error(tmp_path: Path) -> None:
    path = tmp_path / "runs.json"
    head = '{"format": "aelastic.http.runs", "version": '
    contents = [
        b"{not json",
        b"",
        b'{"format": "something else"}',
        (head + '2, "runs": {}}').encode(),
        (head + '1, "runs": {"r": {"state": "!!", "kv": {}}}}').encode(),
        (
            head + '1, "runs": {"r": {"state": "eA==", "epoch": 3, "version": 1, "kv": {}}}}'
        ).encode(),
        (head + '1, "runs": {"r": {"state": null, "kv": {"k": 5}}}}').encode(),
    ]
    for content in contents:
        path.write_bytes(content)
        srv = HttpServer(persist=path)
        try:
            with pytest.raises(RuntimeError, match="cannot be loaded"):
                srv.start()
        finally:
            srv.close()
        assert path.read_bytes() == content  # left as it was


async def test_unwritable_persistence_file_is_503_then_recovers(
    tmp_path: Path, run_id: str
) -> None:
    folder = tmp_path / "state"
    folder.mkdir()
    srv = HttpServer(persist=folder / "runs.json")
    try:
        srv.start()
        async with backend(srv.url, run_id, read_timeout=1.0) as b:
            await b.kv_set("before", b"1")
            folder.rename(tmp_path / "moved")  # the server can no longer write its file
            with pytest.raises(RendezvousConnectionError, match="could not persist"):
                await b.kv_add("n", 1)
            assert srv.running
            folder.mkdir()
            # The change was kept; a retry (same Idempotency-Key) would not apply it twice.
            assert await b.kv_add("n", 1) == 2
        assert json.loads((folder / "runs.json").read_bytes())["runs"][run_id]["kv"]
    finally:
        srv.close()


def test_second_server_on_a_busy_port_fails_clearly(server: HttpServer) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    cmd = [sys.executable, "-m", "aelastic.backends.http.server", "--port", str(server.port)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert f"cannot serve on 127.0.0.1:{server.port}" in done.stderr


async def test_idle_runs_expire() -> None:
    from aelastic.backends.http._runs import RunStore

    store = RunStore()
    old, busy, fresh = store.run("old"), store.run("busy"), store.run("fresh")
    for run in (old, busy, fresh):
        store.state_written(run, b"s")
    old.touched = busy.touched = time.monotonic() - 100
    waiter = asyncio.ensure_future(store.wait_state(busy, 30))
    await asyncio.sleep(0)
    assert store.expire(50) == 1
    assert set(store.runs) == {"busy", "fresh"}
    store.close()
    await waiter


async def test_shutdown_does_not_wait_for_long_polls(own_server: HttpServer, run_id: str) -> None:
    own_server.start()
    async with backend(own_server.url, run_id, read_timeout=2.0) as b:
        waiter = asyncio.ensure_future(b.wait_for_change("", 60))
        await asyncio.sleep(0.2)
        start = time.monotonic()
        assert await anyio.to_thread.run_sync(own_server.stop) == 0
        assert time.monotonic() - start < 5.0
        with anyio.fail_after(PROMPT), pytest.raises(RendezvousConnectionError):
            await waiter


async def test_foreign_state_is_reported_and_left_untouched(
    server: HttpServer, run_id: str
) -> None:
    url = f"{server.url}/v1/runs/{run_id}/state"
    assert (await raw("PUT", url, {"state": b64(b"<html>not a state"), "token": ""}))[0] == 200
    async with group(server.url, run_id, 1, 1, 1) as g:
        with pytest.raises(RendezvousStateError):
            await g[0].next_rendezvous()
    _, doc = await raw("GET", url)
    assert base64.b64decode(doc["state"]) == b"<html>not a state"


# -- bad input ------------------------------------------------------------------------------


async def test_oversized_body_is_413_and_changes_nothing(run_id: str) -> None:
    async with serve_in_loop(max_body=4096) as url, backend(url, run_id) as b:
        _, _, token = await b.compare_and_set(b"small", "")
        status, doc = await raw(
            "PUT", f"{url}/v1/runs/{run_id}/state", {"state": b64(b"x" * 8000), "token": token}
        )
        assert status == 413 and "too large" in doc["error"]
        with pytest.raises(RendezvousConnectionError, match="413"):
            await b.compare_and_set(b"y" * 8000, token)
        assert await b.read() == (b"small", token)


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("PUT", "/state", b"not json"),
        ("PUT", "/state", b"[]"),
        ("PUT", "/state", b'{"state": "!!!", "token": ""}'),
        ("PUT", "/state", b'{"state": "eA==", "token": 5}'),
        ("PUT", "/state", b'{"state": "eA==", "token": "not-a-token"}'),
        ("PUT", "/state", b'{"state": "eA=="}'),
        ("PUT", "/state", b'{"state": "eA==", "token": "", "extra": 1}'),
        ("PUT", "/state?wait=1", b'{"state": "eA==", "token": ""}'),
        ("GET", "/state?wait=5", b""),
        ("GET", "/state?token=x&wait=5", b""),
        ("GET", "/state?token=&wait=-1", b""),
        ("GET", "/state?token=&wait=nan", b""),
        ("GET", "/state?token=&wait=1e9", b""),
        ("POST", "/kv/set", b'{"key": "k"}'),
        ("POST", "/kv/set", b'{"key": 3, "value": "eA=="}'),
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
    server: HttpServer, run_id: str, method: str, path: str, body: bytes
) -> None:
    async with backend(server.url, run_id) as b:
        _, _, token = await b.compare_and_set(b"kept", "")
        await b.kv_set("k", b"v")
        await b.kv_set("n", b"1")
        status, doc = await raw(method, f"{server.url}/v1/runs/{run_id}{path}", data=body)
        assert status == 400, doc
        assert isinstance(doc["error"], str) and doc["error"]
        assert await b.read() == (b"kept", token)
        assert await b.kv_get(["k", "n"]) == [b"v", b"1"]


async def test_unknown_routes_and_methods(server: HttpServer) -> None:
    assert (await raw("GET", f"{server.url}/v2/whatever"))[0] == 404
    status, doc = await raw("POST", f"{server.url}/v1/runs/x/state", {})
    assert status == 405 and doc["error"]


async def test_retried_write_is_applied_once(server: HttpServer, run_id: str) -> None:
    url = f"{server.url}/v1/runs/{run_id}/kv/add"
    headers = {"Idempotency-Key": "abc123"}
    async with aiohttp.ClientSession() as session:
        for _ in range(3):
            async with session.post(url, json={"key": "n", "amount": 2}, headers=headers) as r:
                assert (await r.json())["value"] == 2


# -- deployment -----------------------------------------------------------------------------


async def test_app_mounted_inside_another_aiohttp_app(run_id: str) -> None:
    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="hello")

    parent = web.Application()
    parent.router.add_get("/", hello)
    parent.add_subapp("/rdzv/", create_app(token=TOKEN))
    runner = web.AppRunner(parent)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        async with group(f"{url}/rdzv", run_id, 3, 3, 3, token=TOKEN) as g:
            with anyio.fail_after(PROMPT):
                infos = await asyncio.gather(*(h.next_rendezvous() for h in g))
            assert sorted(i.rank for i in infos) == [0, 1, 2]
            assert await infos[1].store.get("MASTER_ADDR") == b"127.0.0.1"
    finally:
        await runner.cleanup()


async def test_many_handlers_in_one_process_form_one_group(server: HttpServer, run_id: str) -> None:
    async with group(server.url, run_id, 64, 64, 64) as g:
        with anyio.fail_after(30):
            infos = await asyncio.gather(*(h.next_rendezvous() for h in g))
        assert sorted(i.rank for i in infos) == list(range(64))
        assert len({(i.bootstrap_store_info.master_port) for i in infos}) == 1  # type: ignore[union-attr]


async def test_nodes_that_share_nothing_form_one_group(server: HttpServer, run_id: str) -> None:
    # A server without auth ignores tokens, but the client keeps one session per token:
    # each handler is then on its own, like nodes in separate processes (conflicts happen).
    handlers = [
        create_handler(
            RendezvousParameters(
                "http", server.url, run_id, 12, 12, local_addr="127.0.0.1", token=f"t{i}"
            )
        )
        for i in range(12)
    ]
    try:
        with anyio.fail_after(30):
            infos = await asyncio.gather(*(h.next_rendezvous() for h in handlers))
        assert sorted(i.rank for i in infos) == list(range(12))
    finally:
        for h in handlers:
            await h.aclose()


async def test_members_share_the_round_store(server: HttpServer, run_id: str) -> None:
    async with group(server.url, run_id, 3, 3, 3) as g:
        infos = await asyncio.gather(*(h.next_rendezvous() for h in g))
        stores = [i.store for i in infos]
        await stores[0].set("hello", "world")
        assert await stores[2].get("hello", timeout=5) == b"world"
        assert await asyncio.gather(*(s.add("count", 1) for s in stores)) != []
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


def test_cli_picks_a_free_port_and_stops_on_sigint(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    env.pop("AELASTIC_HTTP_TOKEN", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "aelastic.backends.http.server", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("aelastic rendezvous server listening on http://127.0.0.1:")
        port = int(line.rsplit(":", 1)[1])
        assert port > 0
        proc.send_signal(2)
        assert proc.wait(30) == 0
    finally:
        proc.kill()
        proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


def test_persistence_file_format(tmp_path: Path) -> None:
    path = tmp_path / "runs.json"
    with HttpServer(persist=path) as srv:

        async def write() -> None:
            async with backend(srv.url, "r") as b:
                await b.compare_and_set(b"s", "")
                await b.kv_set("k", b"v")

        anyio.run(write)
    doc = json.loads(path.read_bytes())
    assert doc["format"] == "aelastic.http.runs" and doc["version"] == 1
    assert base64.b64decode(doc["runs"]["r"]["state"]) == b"s"
    assert not list(tmp_path.glob(".runs.json.*"))  # no temporary file left behind
