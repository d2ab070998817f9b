"""Forged requests at the level they come in: raw HTTP, raw WebSocket messages, raw EVALSHA.

Two real nodes form a round; another client then sends what an attacker would: a status
with a 1 ms window and other node bounds, a stranger's failure report and "done", and a
leave, a keep-alive, a join, a failure report, a quarantine and a "done" naming a member
without its secret. Nothing is lost: the members stay, the run stays open, the job's health
stays empty, nobody is done, and the members' watch sees no change. The operator's routes
of a server without a token are refused to a request that a proxy forwarded.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import anyio
import pytest

from aelastic.backends.redis import RedisBackend, _lua
from aelastic.core.state import Op
from aelastic.rendezvous import DynamicRendezvousHandler
from tests._http_server import HttpServer
from tests._redis_server import RedisServer
from tests._rendezvous_helpers import PROMPT, handler_group, join_all

pytestmark = pytest.mark.anyio

FORGED = "f0" * 16
TOKEN = "forged-requests-token"
#: What the forger asks with: a 1 ms window, a group of one.
TINY = {"min": 1, "max": 1, "last_call": 1, "window": 1}


#: A forged failure report: round 10^6, blaming whoever it names.
FAILURE = {
    "failure": {
        "time": 0.0, "rank": 0, "local_rank": 0, "exitcode": 1, "message": "forged",
        "stalled": False, "secondary": False,
    }
}  # fmt: skip


def forged(op: Op, node: str, report: dict[str, Any] | None = None) -> dict[str, Any]:
    doc = {
        "op": op.value, "node": node, **TINY, "expired": False, "finished": False, "port": 0,
        "secret": FORGED,
    }  # fmt: skip
    if op is Op.JOIN:
        doc.update(role="default", local_world_size=1)
    if op is Op.REPORT:
        doc["report"] = report or FAILURE
    return doc


def attack(member: str) -> list[dict[str, Any]]:
    """Every forged request: a stranger's with a tiny window, and some for a member."""
    stranger = "10.66.6.6_666_0"
    ops = (Op.STATUS, Op.KEEP_ALIVE, Op.LEAVE, Op.REPORT, Op.DONE)
    return (
        [forged(op, stranger) for op in ops]
        + [
            forged(op, member)
            for op in (Op.LEAVE, Op.KEEP_ALIVE, Op.JOIN, Op.REPORT, Op.DONE, Op.STATUS)
        ]
        + [forged(Op.REPORT, member, {"quarantine": "forged"})]
    )


@asynccontextmanager
async def formed(
    backend: str, endpoint: str, run_id: str
) -> AsyncIterator[list[DynamicRendezvousHandler]]:
    """Two real nodes in a complete round (a 3 s heartbeat window)."""
    conf = {"keep_alive_interval": 1, "keep_alive_max_attempt": 3}
    async with handler_group(backend, endpoint, run_id, 2, 2, 2, **conf) as group:
        await join_all(group)
        yield group


async def nothing_lost(group: list[DynamicRendezvousHandler]) -> None:
    """The round is whole and open, and stays so past the heartbeat window."""
    with anyio.move_on_after(4.0) as quiet:  # longer than the 3 s window
        await group[0].watch()
    assert quiet.cancelled_caught, "the members saw a change"
    snapshot = await group[0].backend.snapshot()
    assert snapshot is not None and not snapshot.status.closed
    assert set(snapshot.ranks()) == {h.node for h in group}
    assert snapshot.status.lost == 0 and snapshot.status.done == 0
    health = await group[0].health()
    assert health is not None and not health.incidents and not health.quarantined


def refused(reply: dict[str, Any], request: dict[str, Any]) -> None:
    assert reply["pruned"] == 0 and not reply["status"]["closed"], request
    assert reply["known"] is False, request
    if not request["node"].startswith("10.66."):
        assert reply["outcome"] in ("error_forbidden", "finish"), request
        if request["op"] != "status":
            assert reply["outcome"] == "error_forbidden", request


# -- HTTP -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[HttpServer]:
    with HttpServer() as srv:
        yield srv


async def test_forged_http_requests_and_channel_messages_lose_nothing(
    server: HttpServer, run_id: str
) -> None:
    async with formed("http", server.url, run_id) as group:
        member = group[0].node.key
        url = f"{server.url}/v1/runs/{run_id}"
        async with aiohttp.ClientSession() as session:
            for request in attack(member):
                async with session.post(url + "/rendezvous", json=request) as resp:
                    assert resp.status == 200
                    refused(await resp.json(), request)
            async with session.ws_connect(server.url + "/v1/channel") as ws:
                for number, request in enumerate(attack(member)):
                    await ws.send_str(json.dumps({"id": number, "run": run_id, "request": request}))
                    with anyio.fail_after(PROMPT):
                        answer = json.loads((await ws.receive()).data)
                    assert answer["id"] == number
                    refused(answer["reply"], request)
        await nothing_lost(group)


async def test_operator_routes_of_a_tokenless_server_refuse_a_forwarded_request(
    server: HttpServer, run_id: str
) -> None:
    async with formed("http", server.url, run_id) as group:
        url = f"{server.url}/v1/runs/{run_id}"
        async with aiohttp.ClientSession() as session:
            for method, path in (("POST", "/close"), ("DELETE", "")):
                for header in ("X-Forwarded-For", "Forwarded", "X-Real-IP"):
                    headers = {header: "203.0.113.7"}
                    async with session.request(method, url + path, headers=headers) as resp:
                        assert resp.status == 403
                        assert "no token" in (await resp.json())["error"]
        assert not await group[0].is_closed()
        async with (  # from this machine, not forwarded
            aiohttp.ClientSession() as session,
            session.post(url + "/close") as resp,
        ):
            assert resp.status == 200 and (await resp.json())["closed"] is True
        assert await group[1].is_closed()


async def test_a_token_server_takes_operator_routes_from_token_holders(run_id: str) -> None:
    with HttpServer(token=TOKEN) as srv:
        url = f"{srv.url}/v1/runs/{run_id}/close"
        async with aiohttp.ClientSession() as session:
            async with session.post(url) as resp:
                assert resp.status == 401
            headers = {"Authorization": f"Bearer {TOKEN}", "X-Forwarded-For": "203.0.113.7"}
            async with session.post(url, headers=headers) as resp:
                assert resp.status == 200 and (await resp.json())["closed"] is False  # no run


# -- Redis ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as srv:
        yield srv


async def test_forged_evalsha_requests_lose_nothing(redis_server: RedisServer, run_id: str) -> None:
    """A client with the Redis credentials calls the rendezvous script itself, as the
    attacker did: forged windows and requests naming a member are refused by the script."""
    async with formed("redis", redis_server.url, run_id) as group:
        backend = group[0].backend
        assert isinstance(backend, RedisBackend)
        keys, channel = backend.keys.rendezvous, backend.keys.channel
        sha = hashlib.sha1(_lua.OP.encode()).hexdigest()
        with redis_server.client() as client:
            client.script_load(_lua.OP)
            for request in attack(group[0].node.key):
                args = [
                    request["op"], request["node"], 1, 1, 1, 1, "0", "0", 0, "", "feed",
                    60_000, channel, "1", FORGED, "0",
                ]  # fmt: skip
                reply = json.loads(
                    await asyncio.to_thread(client.evalsha, sha, len(keys), *keys, *args)
                )
                refused(reply, request)
        await nothing_lost(group)
