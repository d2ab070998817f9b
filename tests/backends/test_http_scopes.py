"""Tokens scoped to a run-id prefix on a real ``aelastic serve`` app: minted and listed ones
reach their own runs only, over HTTP and on the rendezvous channel, and the server's own
token keeps reaching every run."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from aelastic import RendezvousConnectionError
from aelastic.backends.http import HttpBackend
from aelastic.backends.http.server import Scope, load_scoped_tokens, mint
from aelastic.backends.http.server._tenancy import Scopes
from aelastic.core.params import Rules
from aelastic.core.state import NodeDesc, Op, Request
from aelastic.core.wire import request_to_json
from tests._http_server import serve_in_loop
from tests._rendezvous_helpers import PROMPT, SECRET

pytestmark = pytest.mark.anyio

TOKEN = "operator-t0ken-of-the-server"
LISTED = "listed-token-for-team-b-0123456789"
RULES = Rules(min_nodes=1, max_nodes=2, last_call_ms=100, window_ms=600_000)


def join(pid: int, op: Op = Op.JOIN) -> dict[str, Any]:
    return request_to_json(Request(op, NodeDesc("10.0.0.9", pid, 0), RULES, secret=SECRET))


async def call(
    method: str, url: str, token: str | None, body: Any = None
) -> tuple[int, dict[str, Any]]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with (
        aiohttp.ClientSession(headers=headers) as session,
        session.request(method, url, json=body) as answer,
    ):
        return answer.status, await answer.json(content_type=None)


def test_a_minted_token_names_its_prefix_and_cannot_be_made_without_the_secret() -> None:
    token = mint(TOKEN, "team-a/")
    assert token.startswith("aelastic.s1.") and TOKEN not in token
    assert mint(TOKEN, "team-a/") == token  # derived: the same every time
    scopes = Scopes(TOKEN)
    scope = scopes.resolve(f"Bearer {token}")
    assert scope is not None and scope.prefix == "team-a/"
    assert scope.allows("team-a/job-1") and not scope.allows("team-b/job-1")
    assert scopes.resolve(f"Bearer {TOKEN}") == Scope()  # the operator: every run
    # Minted with another secret, or its prefix swapped for another: no scope at all.
    assert scopes.resolve(f"Bearer {mint('another-secret', 'team-a/')}") is None
    other = mint(TOKEN, "team-b/")
    forged = token.rsplit(".", 1)[0] + "." + other.rsplit(".", 1)[1]
    assert scopes.resolve(f"Bearer {forged}") is None
    for junk in ("", "Bearer ", "Bearer aelastic.s1.", "Bearer aelastic.s1.!!.x", token):
        assert scopes.resolve(junk) is None
    with pytest.raises(ValueError, match="server's token"):
        mint("", "team-a/")
    with pytest.raises(ValueError, match="prefix"):
        mint(TOKEN, "")


async def test_a_scoped_token_reaches_its_runs_only(run_id: str) -> None:
    token = mint(TOKEN, "team-a/")
    async with serve_in_loop(token=TOKEN) as url:
        mine, theirs = f"{url}/v1/runs/team-a%2F{run_id}", f"{url}/v1/runs/team-b%2F{run_id}"
        value = {"key": "k", "value": "dg=="}
        assert (await call("POST", mine + "/kv/set", token, value))[0] == 200
        assert (await call("POST", mine + "/rendezvous", token, join(1)))[0] == 200
        assert (await call("POST", theirs + "/kv/set", TOKEN, value))[0] == 200  # operator
        assert (await call("POST", theirs + "/rendezvous", TOKEN, join(2)))[0] == 200
        # Every route of another run is refused, naming the rule, and changes nothing.
        refused = [
            ("POST", theirs + "/kv/set", value),
            ("POST", theirs + "/kv/get", {"keys": ["k"]}),
            ("POST", theirs + "/kv/delete", {"key": "k"}),
            ("POST", theirs + "/rendezvous", join(3)),
            ("GET", theirs + "/status", None),
            ("GET", theirs, None),
            ("POST", theirs + "/close", {}),
            ("DELETE", theirs, None),
            ("GET", url + "/metrics", None),
        ]
        for method, where, body in refused:
            status, doc = await call(method, where, token, body)
            assert status == 403, (method, where, doc)
            assert "'team-a/'" in doc["error"] and "scoped token" in doc["error"], doc
        snapshot = (await call("GET", theirs, TOKEN))[1]
        assert [m[0] for m in snapshot["participants"]] == [NodeDesc("10.0.0.9", 2, 0).key]
        assert not snapshot["status"]["closed"]
        # The list shows its own runs only; the operator's shows all.
        listed = (await call("GET", url + "/v1/runs", token))[1]["runs"]
        assert [r["run_id"] for r in listed] == [f"team-a/{run_id}"]
        every = (await call("GET", url + "/v1/runs", TOKEN))[1]["runs"]
        assert {r["run_id"] for r in every} == {f"team-a/{run_id}", f"team-b/{run_id}"}
        assert (await call("GET", url + "/v1/health", token))[0] == 200
        # Its own run: it may close it (a holder of the run's credentials, as in torch).
        status, doc = await call("POST", mine + "/close", token, {})
        assert status == 200 and doc["closed"] is True


async def test_a_scoped_token_s_channel_carries_its_runs_only(run_id: str) -> None:
    token = mint(TOKEN, "team-a/")
    async with (
        serve_in_loop(token=TOKEN) as url,
        aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as session,
        session.ws_connect(url + "/v1/channel") as ws,
    ):
        for msg_id, run in ((1, f"team-b/{run_id}"), (2, f"team-a/{run_id}")):
            await ws.send_str(json.dumps({"id": msg_id, "run": run, "request": join(1)}))
            answer = json.loads((await asyncio.wait_for(ws.receive(), PROMPT)).data)
            assert answer["id"] == msg_id
            if msg_id == 1:
                assert answer["status"] == 403 and "'team-a/'" in answer["error"], answer
            else:
                assert answer["reply"]["outcome"] != "error_forbidden", answer


async def test_the_aelastic_client_with_a_scoped_token(run_id: str) -> None:
    token = mint(TOKEN, "team-a/")
    async with serve_in_loop(token=TOKEN) as url:
        own = HttpBackend(f"team-a/{run_id}", url, token=token, read_timeout=PROMPT)
        other = HttpBackend(f"team-b/{run_id}", url, token=token, read_timeout=PROMPT)
        try:
            await own.kv_set("k", b"v")
            assert await own.kv_get(["k"]) == [b"v"]
            with pytest.raises(RendezvousConnectionError, match=r"403.*'team-a/'"):
                await other.kv_set("k", b"v")
            with pytest.raises(RendezvousConnectionError, match=r"403.*'team-a/'"):
                await other.snapshot()
        finally:
            await own.aclose()
            await other.aclose()


async def test_listed_tokens_from_a_file(tmp_path: Path, run_id: str) -> None:
    listing = tmp_path / "tokens"
    listing.write_text(f"# team b's jobs\n\n{LISTED}  team-b/\n")
    listing.chmod(0o600)
    async with serve_in_loop(token=TOKEN, scoped_tokens=listing) as url:
        runs = f"{url}/v1/runs"
        value = {"key": "k", "value": "dg=="}
        assert (await call("POST", f"{runs}/team-b%2F{run_id}/kv/set", LISTED, value))[0] == 200
        status, doc = await call("POST", f"{runs}/team-a%2F{run_id}/kv/set", LISTED, value)
        assert status == 403 and "line 3" in doc["error"] and "'team-b/'" in doc["error"]
        assert LISTED not in doc["error"]  # a token is never named
        assert (await call("POST", f"{runs}/x/kv/set", LISTED + "x", value))[0] == 401
        assert (await call("POST", f"{runs}/x/kv/set", TOKEN, value))[0] == 200


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("short team-a/\n", "at least 16 characters"),
        (f"{LISTED}\n", "expected 'TOKEN RUN_ID_PREFIX'"),
        (f"{LISTED} a b\n", "expected 'TOKEN RUN_ID_PREFIX'"),
        (f"{LISTED} a/\n{LISTED} b/\n", "line 2: this token is listed twice"),
        ("aelastic.s1.abcdefghijklmnop a/\n", "like a minted one"),
    ],
)
def test_a_bad_scoped_tokens_file_is_refused_naming_the_line(
    tmp_path: Path, text: str, said: str
) -> None:
    listing = tmp_path / "tokens"
    listing.write_text(text)
    with pytest.raises(ValueError, match=said):
        load_scoped_tokens(listing)


def test_a_scoped_tokens_file_open_to_others_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    listing = tmp_path / "tokens"
    listing.write_text(f"{LISTED} team-b/\n")
    os.chmod(listing, 0o644)
    with caplog.at_level(logging.WARNING):
        assert set(load_scoped_tokens(listing)) == {LISTED}
    assert "can be read or written by other users" in caplog.text and "chmod 600" in caplog.text
    caplog.clear()
    os.chmod(listing, 0o600)
    load_scoped_tokens(listing)
    assert "other users" not in caplog.text


def test_scoped_tokens_need_the_server_s_own_token() -> None:
    with pytest.raises(ValueError, match="need the server's own token"):
        Scopes(None, {LISTED: Scope("team-b/", "x")})
    with pytest.raises(ValueError, match="is the server's own token"):
        Scopes(LISTED, {LISTED: Scope("team-b/", "x")})
