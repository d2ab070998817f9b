"""A member whose workers' collective broke says so on its channel: the server then loses the
members whose channels it saw end at once, without the rest of their grace (the loss is
seen from two sides). Only a member can say it; a cut of most channels at once keeps its
grace; a node heard from since stays.

Real parts: the HTTP server in the test's loop, each node on a WebSocket of its own; a
channel's end is its server-side socket aborted (no close frame, as a killed process's)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import aiohttp
import anyio
import pytest

from aelastic.backends.http.client import HttpBackend
from aelastic.core.state import Op, Request
from aelastic.core.wire import request_to_json, status_from_json
from tests._rendezvous_helpers import SECRET
from tests.backends.test_http_channel import RULES, Seen, exchange, node, server

pytestmark = pytest.mark.anyio

FORGED = "f0" * 16


def message(msg_id: int, run_id: str, op: Op, index: int, **extra: Any) -> dict[str, Any]:
    secret = extra.pop("secret", SECRET)
    body = request_to_json(Request(op, node(index), RULES, secret=secret))
    return {"id": msg_id, "run": run_id, "request": body, **extra}


@asynccontextmanager
async def three_members(
    run_id: str,
) -> AsyncIterator[tuple[str, Seen, list[aiohttp.ClientWebSocketResponse]]]:
    """A complete round of three nodes, each on a channel of its own (``seen.channels[i]``
    is node ``i``'s, on the server's side)."""
    async with (
        server() as (url, seen, _),
        aiohttp.ClientSession() as session,
        AsyncExitStack() as stack,
    ):
        sockets = []
        for i in range(3):
            ws = await stack.enter_async_context(session.ws_connect(url + "/v1/channel"))
            doc = await exchange(ws, message(i, run_id, Op.JOIN, i))
            assert "reply" in doc, doc
            sockets.append(ws)
        yield url, seen, sockets


async def status(url: str, run_id: str) -> Any:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{url}/v1/runs/{run_id}/status") as response,
    ):
        return status_from_json(await response.json())


async def until_lost(url: str, run_id: str, within: float) -> None:
    """Until the run counts a lost member (polled: the server has no event for a test)."""
    with anyio.fail_after(within):
        while (await status(url, run_id)).lost == 0:  # noqa: ASYNC110
            await anyio.sleep(0.02)


async def test_a_members_report_loses_a_departed_node_at_once(run_id: str) -> None:
    async with three_members(run_id) as (url, seen, (a, _, _)):
        seen.channels[2].abort()  # node 2's process died: its channel ended, no goodbye
        await anyio.sleep(0.05)
        assert (await status(url, run_id)).lost == 0  # within its grace (1 s)
        doc = await exchange(a, message(10, run_id, Op.KEEP_ALIVE, 0, broken=True))
        assert doc == {"id": 10, "departed": 1}  # before the grace: confirmed
        after = await status(url, run_id)
        assert after.lost == 1 and after.participants == 2


async def test_a_report_just_before_the_channel_ends_confirms_it_too(run_id: str) -> None:
    async with three_members(run_id) as (url, seen, (a, _, _)):
        doc = await exchange(a, message(10, run_id, Op.KEEP_ALIVE, 0, broken=True))
        assert doc == {"id": 10, "departed": 0}  # nothing had ended yet
        seen.channels[2].abort()
        await until_lost(url, run_id, 0.8)  # long before its grace (1 s)


async def test_only_a_member_can_report_and_only_with_a_keep_alive(run_id: str) -> None:
    async with three_members(run_id) as (url, seen, (a, _, _)):
        seen.channels[2].abort()
        forged = message(10, run_id, Op.KEEP_ALIVE, 1, secret=FORGED, broken=True)
        assert await exchange(a, forged) == {"id": 10, "departed": 0}
        stranger = message(11, run_id, Op.KEEP_ALIVE, 7, broken=True)
        assert await exchange(a, stranger) == {"id": 11, "departed": 0}
        for msg_id, wrong in [
            (12, message(12, run_id, Op.JOIN, 0, broken=True)),
            (13, message(13, run_id, Op.KEEP_ALIVE, 0, broken="yes")),
            (14, message(14, run_id, Op.KEEP_ALIVE, 0, broken=False) | {"broken": 1}),
        ]:
            doc = await exchange(a, wrong)
            assert doc["id"] == msg_id and doc["status"] == 400, doc
        assert (await status(url, run_id)).lost == 0  # left to its grace
        await until_lost(url, run_id, 10.0)  # then lost


async def test_many_channels_ending_at_once_keep_their_grace(run_id: str) -> None:
    async with three_members(run_id) as (url, seen, (a, _, _)):
        seen.channels[1].abort()  # two of three: a network cut, not two deaths
        seen.channels[2].abort()
        await anyio.sleep(0.05)
        doc = await exchange(a, message(10, run_id, Op.KEEP_ALIVE, 0, broken=True))
        assert doc == {"id": 10, "departed": 0}
        assert (await status(url, run_id)).lost == 0


async def test_a_departed_node_heard_from_since_stays(run_id: str) -> None:
    async with (
        three_members(run_id) as (url, seen, (a, _, _)),
        aiohttp.ClientSession() as session,
        session.ws_connect(url + "/v1/channel") as again,
    ):
        seen.channels[2].abort()
        await anyio.sleep(0.05)  # its client reconnects and beats at once
        assert "reply" in await exchange(again, message(10, run_id, Op.KEEP_ALIVE, 2))
        doc = await exchange(a, message(11, run_id, Op.KEEP_ALIVE, 0, broken=True))
        assert doc == {"id": 11, "departed": 0}
        await anyio.sleep(1.2)  # past its grace
        assert (await status(url, run_id)).lost == 0


@pytest.mark.parametrize("sent", [Op.JOIN, Op.KEEP_ALIVE])
async def test_the_client_reports_as_its_node(run_id: str, sent: Op) -> None:
    """With its last keep-alive, or its join's secret before its first beat."""
    async with three_members(run_id) as (url, seen, _):
        backend = HttpBackend(run_id, url)
        try:
            assert await backend.report_departures(node(0)) == 0  # nothing sent yet
            await backend.apply(Request(sent, node(0), RULES, secret=SECRET))
            seen.channels[2].abort()
            await anyio.sleep(0.05)
            assert await backend.report_departures(node(1)) == 0  # not its node
            assert await backend.report_departures(node(0)) == 1
        finally:
            await backend.aclose()
        assert (await status(url, run_id)).lost == 1


@pytest.mark.parametrize("over", ["http", "channel"])
async def test_a_node_whose_beat_came_again_before_its_channels_end_was_read_stays(
    run_id: str, over: str
) -> None:
    """Its client saw the cut first and sent its keep-alive again (over HTTP, as the client
    does when its channel fails mid-request, or on a new channel), held by the server,
    before the server read the old channel's end: no beat comes during the grace, the one
    sent is held. It is alive, through the grace and a member's report alike."""
    async with (
        three_members(run_id) as (url, seen, (a, _, _)),
        aiohttp.ClientSession() as session,
        session.ws_connect(url + "/v1/channel") as again,
    ):
        token = (await status(url, run_id)).token
        beat = request_to_json(Request(Op.KEEP_ALIVE, node(2), RULES, secret=SECRET))
        if over == "http":
            held: Any = session.post(
                f"{url}/v1/runs/{run_id}/rendezvous",
                json=beat,
                params={"hold": "30", "seen": token},
            )
        async with anyio.create_task_group() as tg:
            if over == "http":

                async def hold_it() -> None:
                    async with held as response:
                        await response.read()

                tg.start_soon(hold_it)
            else:
                await again.send_json(
                    {"id": 20, "run": run_id, "request": beat, "hold": 30, "seen": token}
                )
            await anyio.sleep(0.3)  # held by now
            seen.channels[2].abort()  # then the old channel's end is read
            await anyio.sleep(0.05)
            doc = await exchange(a, message(11, run_id, Op.KEEP_ALIVE, 0, broken=True))
            assert doc == {"id": 11, "departed": 0}
            await anyio.sleep(1.2)  # past its grace
            assert (await status(url, run_id)).lost == 0
            tg.cancel_scope.cancel()


async def test_a_forged_held_beat_does_not_keep_a_departed_node(run_id: str) -> None:
    """A keep-alive held for node 2 under another secret (a token holder, not node 2) proves
    nothing: node 2's channel ends, a member's report loses it at once."""
    async with (
        three_members(run_id) as (url, seen, (a, _, _)),
        aiohttp.ClientSession() as session,
        session.ws_connect(url + "/v1/channel") as forger,
    ):
        token = (await status(url, run_id)).token
        beat = request_to_json(Request(Op.KEEP_ALIVE, node(2), RULES, secret=FORGED))
        await forger.send_json(
            {"id": 20, "run": run_id, "request": beat, "hold": 30, "seen": token}
        )
        await anyio.sleep(0.3)
        seen.channels[2].abort()
        await anyio.sleep(0.05)
        doc = await exchange(a, message(11, run_id, Op.KEEP_ALIVE, 0, broken=True))
        assert doc == {"id": 11, "departed": 1}
        assert (await status(url, run_id)).lost == 1
