"""The pages of a real ``aelastic serve`` against a hostile browser or script: the login's
form and ``next``, sessions and logout, HTTPS behind a proxy, and event streams.

Raw HTTP requests play the clients, each from a loopback address of its own where the
server counts per client (any 127.x.y.z reaches it on Linux). The server's log must hold
no traceback.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from http.cookies import SimpleCookie
from typing import Any
from urllib.parse import quote

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aelastic.core.params import Rules
from aelastic.core.state import NodeDesc, Op, Request
from aelastic.core.wire import request_to_json
from aelastic.web.pages import COOKIE, MAX_STREAMS_PER_CLIENT
from tests._http_server import HttpServer
from tests._rendezvous_helpers import PROMPT, SECRET

TOKEN = "pages-t0ken"
FORM = "application/x-www-form-urlencoded"
_sources = itertools.count()


def fresh_address() -> str:
    """A loopback address of its own (127.0.2.0-255 in turn): wrong tokens sent by the
    fuzzer must not make its next requests wait (the server limits failures per client)."""
    return f"127.0.2.{next(_sources) % 256}"


@asynccontextmanager
async def client_at(address: str = "127.0.0.1") -> AsyncIterator[aiohttp.ClientSession]:
    connector = aiohttp.TCPConnector(local_addr=(address, 0))
    jar = aiohttp.DummyCookieJar()  # cookies are sent by hand: each test says which
    async with aiohttp.ClientSession(connector=connector, cookie_jar=jar) as session:
        yield session


async def post(
    url: str,
    data: bytes | str | dict[str, str],
    *,
    address: str = "127.0.0.1",
    headers: dict[str, str] | None = None,
) -> tuple[int, str, Any]:
    """One POST on a new connection from ``address``: status, text, headers."""
    sent = dict(headers or {})
    if not isinstance(data, dict):
        sent.setdefault("Content-Type", FORM)
    async with (
        client_at(address) as session,
        session.post(url, data=data, headers=sent, allow_redirects=False) as answer,
    ):
        return answer.status, await answer.text(), answer.headers


async def get(url: str, *, address: str = "127.0.0.1", cookie: str | None = None) -> int:
    headers = {"Cookie": f"{COOKIE}={cookie}"} if cookie else {}
    async with client_at(address) as session, session.get(url, headers=headers) as answer:
        return answer.status


def session_of(headers: Any) -> tuple[str, Any]:
    """The session cookie a login set: (value, its morsel)."""
    jar: SimpleCookie = SimpleCookie()
    jar.load(headers["Set-Cookie"])
    return jar[COOKIE].value, jar[COOKIE]


@pytest.fixture(scope="module")
def server() -> Iterator[HttpServer]:
    with HttpServer(token=TOKEN) as srv:
        yield srv


def clean_log(server: HttpServer) -> None:
    log = server.stderr
    assert "Traceback" not in log and "internal error" not in log, log


# -- the login's form ---------------------------------------------------------------------

BAD_NEXT = [
    "runs/a\r\nSet-Cookie: x=1",
    "runs/a\nx",
    "runs/a%0d%0aX-Evil:%201",
    "//evil.example/x",
    "https://evil.example/",
    "/runs/a",
    "runs/../../etc",
    "runs/a/b",
    "runs/",
    "runs/%ff",
    "runs/%zz",
    "runs/" + "x" * 2000,
    "runs/é",
    "\x00",
    "javascript:alert(1)",
]


@pytest.mark.anyio
async def test_a_bad_next_or_form_is_a_400_never_a_traceback(server: HttpServer) -> None:
    login = server.url + "/login"
    for next_path in BAD_NEXT:
        status, text, _ = await post(login, {"token": TOKEN, "next": next_path})
        assert status == 400, (next_path, text)
        assert "Not a login" in text
    bodies: list[tuple[bytes | str, dict[str, str]]] = [
        (b"token=x&next=", {"Content-Type": "multipart/form-data"}),
        (b"--b\r\nbroken", {"Content-Type": "multipart/form-data; boundary=b"}),
        (b"token=x", {"Content-Type": f"{FORM}; charset=klingon"}),
        (b"token=\xff\xfe&next=", {}),
        (b"token=%ff&next=", {}),
        (b"token=a&token=b", {}),
        (b"next=runs/a&next=runs/b&token=x", {}),
        ("&".join(f"f{i}=1" for i in range(20)), {}),
        (b"token=" + b"x" * 20_000, {}),
        (json.dumps({"token": TOKEN}), {"Content-Type": "application/json"}),
    ]
    for body, headers in bodies:
        status, text, _ = await post(login, body, headers=headers)
        assert status == 400, (body[:40], text)
    # The form as a browser sends it still works, and a valid next is kept.
    run = "a run/é?"
    next_path = "runs/" + quote(run, safe="")
    status, _, headers = await post(login, {"token": TOKEN, "next": next_path})
    assert status == 303 and headers["Location"] == "./" + next_path
    clean_log(server)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    next_path=st.one_of(
        st.text(max_size=40),
        st.text(alphabet="runs/%0aA\r\n:.", max_size=20).map(lambda t: "runs/" + t),
    ),
    token=st.one_of(st.just(TOKEN), st.text(max_size=20)),
)
def test_fuzzed_logins_are_answered_cleanly(server: HttpServer, next_path: str, token: str) -> None:
    status, _, headers = asyncio.run(
        post(
            server.url + "/login",
            {"token": token, "next": next_path},
            address=fresh_address(),
        )
    )
    assert status in (303, 400, 401), status
    if status == 303:
        location = headers["Location"]
        assert location == "./" + next_path and "\n" not in location and "\r" not in location
        assert next_path == "" or next_path.startswith("runs/")
    clean_log(server)


# -- sessions -----------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_session_is_random_and_ends_at_its_logout(server: HttpServer) -> None:
    url = server.url
    own = {"Origin": url}
    first_status, _, first_headers = await post(url + "/login", {"token": TOKEN}, headers=own)
    second_status, _, second_headers = await post(url + "/login", {"token": TOKEN})
    assert first_status == second_status == 303
    first, morsel = session_of(first_headers)
    second, _ = session_of(second_headers)
    assert first != second and len(first) >= 40 and TOKEN not in first
    assert morsel["httponly"] and morsel["samesite"] == "Strict" and morsel["path"] == "/"
    assert not morsel["secure"]  # plain HTTP: a Secure cookie would never come back
    assert int(morsel["max-age"]) > 0
    for cookie in (first, second):
        assert await get(url + "/", cookie=cookie) == 200
    assert await get(url + "/", cookie="made-up") == 401
    assert await get(url + "/", cookie=first + "x") == 401

    # A logout needs a POST from the pages themselves.
    async with client_at() as session:
        cookie = {"Cookie": f"{COOKIE}={first}"}
        async with session.get(url + "/logout", headers=cookie) as answer:
            assert answer.status in (401, 405)  # (no such page: the API's 401, uncounted)
        for foreign in ({"Origin": "http://evil.example"}, {"Sec-Fetch-Site": "cross-site"}):
            async with session.post(url + "/logout", headers={**cookie, **foreign}) as answer:
                assert answer.status == 403
    assert await get(url + "/", cookie=first) == 200
    status, _, headers = await post(
        url + "/logout", b"", headers={"Cookie": f"{COOKIE}={first}", **own}
    )
    assert status == 303 and headers["Location"] == "./"
    assert f"{COOKIE}=" in headers["Set-Cookie"]  # the browser's copy is dropped too
    # The cookie opens nothing any more, even replayed; the other session still works.
    assert await get(url + "/", cookie=first) == 401
    assert await get(url + "/stream", cookie=first) == 401
    assert await get(url + "/", cookie=second) == 200
    clean_log(server)


@pytest.mark.anyio
async def test_behind_a_trusted_tls_proxy_the_cookie_is_secure() -> None:
    proxied = {
        "X-Forwarded-Proto": "https",
        "X-Forwarded-Host": "rdzv.example.com",
        "X-Forwarded-For": "203.0.113.9",
        "Origin": "https://rdzv.example.com",
    }
    with HttpServer(token=TOKEN, extra_args=("--trusted-proxy", "127.0.0.1/32")) as server:
        login = server.url + "/login"
        status, _, headers = await post(login, {"token": TOKEN}, headers=proxied)
        assert status == 303
        value, morsel = session_of(headers)
        assert morsel["secure"] and morsel["httponly"]
        # The same headers from a peer that is not the proxy are nobody's word.
        status, text, _ = await post(login, {"token": TOKEN}, address="127.0.0.2", headers=proxied)
        assert status == 403 and "--trusted-proxy" in text
        plain = {k: v for k, v in proxied.items() if k != "Origin"}
        status, _, headers = await post(login, {"token": TOKEN}, address="127.0.0.2", headers=plain)
        assert status == 303 and not session_of(headers)[1]["secure"]
        # A logout through the proxy.
        status, _, headers = await post(
            server.url + "/logout", b"", headers={**proxied, "Cookie": f"{COOKIE}={value}"}
        )
        assert status == 303 and "Secure" in headers["Set-Cookie"]
        assert await get(server.url + "/", cookie=value) == 401
        clean_log(server)
    # Without the setting, a browser that came over HTTPS is told what to set.
    with HttpServer(token=TOKEN) as server:
        status, text, _ = await post(server.url + "/login", {"token": TOKEN}, headers=proxied)
        assert status == 403 and "--trusted-proxy" in text


# -- event streams ------------------------------------------------------------------------


def _join_body(pid: int) -> dict[str, Any]:
    rules = Rules(min_nodes=5, max_nodes=5, last_call_ms=600_000, window_ms=600_000)
    return request_to_json(Request(Op.JOIN, NodeDesc("10.0.0.1", pid, 0), rules, secret=SECRET))


async def _open_stream(
    session: aiohttp.ClientSession, url: str
) -> tuple[int, aiohttp.ClientResponse]:
    response = await session.get(url)
    if response.status == 200:
        await asyncio.wait_for(response.content.readline(), PROMPT)  # "retry: ..."
    return response.status, response


@pytest.mark.anyio
async def test_event_streams_are_bounded_per_client_and_never_for_made_up_runs(
    run_id: str,
) -> None:
    with HttpServer() as server:  # no token: anyone may look, within limits
        async with client_at() as session:
            body = _join_body(1)
            async with session.post(f"{server.url}/v1/runs/{run_id}/rendezvous", json=body):
                pass
        stream = f"{server.url}/runs/{run_id}/stream"
        async with client_at("127.0.0.2") as session:
            # 70 made-up runs: 404 each, and nothing is held for them.
            for i in range(70):
                status, response = await _open_stream(session, f"{server.url}/runs/no-{i}/stream")
                response.close()
                assert status == 404
            held = []
            for _ in range(MAX_STREAMS_PER_CLIENT):
                status, response = await _open_stream(session, stream)
                assert status == 200
                held.append(response)
            status, response = await _open_stream(session, stream)
            assert status == 429 and "Retry-After" in response.headers
            assert "close a page first" in (await response.json())["error"]
            response.close()
            # Another client is not locked out (of this run or of the list).
            async with client_at("127.0.0.3") as other:
                for where in (stream, server.url + "/stream"):
                    status, response = await _open_stream(other, where)
                    assert status == 200
                    response.close()
            for response in held:
                response.close()

            # The streams' places come back within a second or so of their browser leaving.
            async def reopened() -> None:
                while True:
                    status, response = await _open_stream(session, stream)
                    response.close()
                    if status == 200:
                        return
                    await asyncio.sleep(0.2)

            await asyncio.wait_for(reopened(), PROMPT)
        clean_log(server)
