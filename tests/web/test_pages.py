"""The pages of a real HTTP rendezvous server (in this loop): routes, streams, the token."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import aiohttp
import anyio
import pytest

from aelastic import RendezvousParameters
from aelastic.backends import create_backend
from aelastic.core.state import NodeDesc, Op, Request
from aelastic.rendezvous import RendezvousSettings
from aelastic.web.pages import COOKIE, serve_pages
from tests._http_server import serve_in_loop
from tests._rendezvous_helpers import PROMPT, SECRET

pytestmark = pytest.mark.anyio

TOKEN = "s3cret-t0ken"


async def _join(url: str, run_id: str, token: str = "") -> None:
    params = RendezvousParameters("http", url, run_id, 1, 1, token=token)
    backend = create_backend(params)
    try:
        rules = RendezvousSettings.from_parameters(params).rules
        await backend.apply(Request(Op.JOIN, NodeDesc("127.0.0.1", 4242, 0), rules, secret=SECRET))
    finally:
        await backend.aclose()


async def _first_event(response: aiohttp.ClientResponse) -> dict[str, object]:
    assert response.headers["Content-Type"].startswith("text/event-stream")
    with anyio.fail_after(PROMPT):
        async for line in response.content:
            if line.startswith(b"data: "):
                doc: dict[str, object] = json.loads(line[len(b"data: ") :])
                return doc
    raise AssertionError("the stream ended without an event")


@pytest.fixture
async def open_server() -> AsyncIterator[str]:
    async with serve_in_loop(pages=serve_pages) as url:
        yield url


async def test_pages_list_the_runs_and_stream_a_run(open_server: str, run_id: str) -> None:
    url = open_server
    await _join(url, run_id)
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/") as answer:
            assert answer.status == 200 and answer.content_type == "text/html"
            assert "script-src 'self'" in answer.headers["Content-Security-Policy"]
            assert 'data-view="runs"' in await answer.text()
        async with session.get(url + "/stream") as answer:
            runs = await _first_event(answer)
        assert [r["run_id"] for r in runs["runs"]] == [run_id]  # type: ignore[index]
        async with session.get(f"{url}/runs/{run_id}") as answer:
            assert answer.status == 200 and 'data-view="run"' in await answer.text()
        async with session.get(f"{url}/runs/{run_id}/stream") as answer:
            view = await _first_event(answer)
        assert view["state"] == "complete" and view["round"] == 0
        members = view["participant_list"]
        assert [(m["node"], m["rank"]) for m in members] == [("127.0.0.1_4242_0", 0)]  # type: ignore[index, union-attr]
        async with session.get(url + "/static/app.js") as answer:
            assert answer.status == 200 and "aelasticLoadedAt" in await answer.text()


async def test_bad_input_gets_404s(open_server: str) -> None:
    url = open_server
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/no/such/route") as answer:
            assert answer.status == 404 and (await answer.json())["error"]
        async with session.get(url + "/static/secrets.txt") as answer:
            assert answer.status == 404 and answer.content_type == "application/json"
        async with session.get(url + "/runs/nobody-here") as answer:
            assert answer.status == 404 and answer.content_type == "text/html"
            assert "No run &#x27;nobody-here&#x27;" in await answer.text()
        async with session.get(url + "/runs/" + "x" * 300) as answer:
            assert answer.status == 404 and "Not a run id" in await answer.text()
        async with session.get(url + "/runs/%3Cscript%3E") as answer:
            text = await answer.text()
            assert answer.status == 404 and "<script>" not in text and "&lt;script&gt;" in text


async def test_with_a_token_the_pages_need_it_and_the_api_keeps_the_bearer(
    run_id: str,
) -> None:
    async with serve_in_loop(token=TOKEN, pages=serve_pages) as url:
        await _join(url, run_id, TOKEN)
        bearer = {"Authorization": f"Bearer {TOKEN}"}
        jar = aiohttp.CookieJar(unsafe=True)  # keep cookies of an IP address (127.0.0.1)
        async with aiohttp.ClientSession(cookie_jar=jar) as session:
            async with session.get(f"{url}/runs/{run_id}") as answer:
                text = await answer.text()
                assert answer.status == 401 and 'name="token"' in text and "Log in" in text
                assert run_id in text and TOKEN not in text
            async with session.get(url + "/stream") as answer:
                assert answer.status == 401
            async with session.get(url + "/v1/runs") as answer:
                assert answer.status == 401
            async with session.get(url + "/v1/runs", headers=bearer) as answer:
                assert answer.status == 200
            async with session.get(url + "/", headers=bearer) as answer:
                assert answer.status == 200  # the bearer header opens the pages too
            form = {"token": "wrong", "next": f"runs/{run_id}"}
            async with session.post(url + "/login", data=form, allow_redirects=False) as answer:
                assert answer.status == 401 and "not the right one" in await answer.text()
                assert COOKIE not in answer.cookies
            foreign = {"Origin": "http://evil.example"}
            form = {"token": TOKEN, "next": ""}
            async with session.post(
                url + "/login", data=form, headers=foreign, allow_redirects=False
            ) as answer:
                assert answer.status == 403
            form = {"token": TOKEN, "next": "//evil.example/x"}
            async with session.post(url + "/login", data=form, allow_redirects=False) as answer:
                assert answer.status == 400 and COOKIE not in answer.cookies
            form = {"token": TOKEN, "next": ""}
            async with session.post(url + "/login", data=form, allow_redirects=False) as answer:
                assert answer.status == 303 and answer.headers["Location"] == "./"
                cookie = answer.headers["Set-Cookie"]
            assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and TOKEN not in cookie
            form = {"token": TOKEN, "next": f"runs/{run_id}"}
            async with session.post(url + "/login", data=form) as answer:
                assert answer.status == 200 and answer.url.path == f"/runs/{run_id}"
                assert 'data-view="run"' in await answer.text()
            async with session.get(f"{url}/runs/{run_id}/stream") as answer:
                view = await _first_event(answer)
            assert view["run_id"] == run_id
            async with session.get(url + "/v1/runs") as answer:
                assert answer.status == 401  # the cookie opens the pages, never the API
            async with session.post(url + "/logout", allow_redirects=False) as answer:
                assert answer.status == 303
            async with session.get(url + "/") as answer:
                assert answer.status == 401
