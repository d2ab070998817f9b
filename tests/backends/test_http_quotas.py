"""The quotas of a real ``aelastic serve`` app: runs a client or a scoped token may make (so
many per window, so many at once), bytes the members' stores may hold, and abandoned runs
forgotten after minutes (here, a fraction of a second).

A client that is not on loopback is played by ``X-Forwarded-For`` sent from the trusted
proxy's address (127.0.0.1); a scoped token counts wherever it comes from.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aelastic.backends._engine import Engine, kv_entry_size
from aelastic.backends.http.server import Quotas, mint
from aelastic.core.params import Rules
from aelastic.core.state import NodeDesc, Op, Request
from aelastic.core.wire import request_to_json
from tests._http_server import serve_in_loop
from tests._rendezvous_helpers import PROMPT, SECRET

pytestmark = pytest.mark.anyio

TOKEN = "operator-t0ken-of-the-server"
#: Rules of a run that stays forming (a join is answered "wait" at once).
FORMING = Rules(min_nodes=5, max_nodes=8, last_call_ms=600_000, window_ms=600_000)


def join(pid: int, op: Op = Op.JOIN, rules: Rules = FORMING) -> dict[str, Any]:
    return request_to_json(Request(op, NodeDesc("10.0.0.9", pid, 0), rules, secret=SECRET))


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


class Client:
    """Requests with one token, from one address behind the proxy (``None``: loopback)."""

    def __init__(self, session: aiohttp.ClientSession, url: str, behind: str | None) -> None:
        self.session = session
        self.url = url
        self.headers = {} if behind is None else {"X-Forwarded-For": behind}

    async def call(
        self, method: str, path: str, body: Any = None
    ) -> tuple[int, dict[str, Any], Any]:
        async with self.session.request(
            method, self.url + path, json=body, headers=self.headers
        ) as answer:
            return answer.status, await answer.json(content_type=None), answer.headers

    async def kv_set(self, run: str, key: str, value: bytes) -> tuple[int, dict[str, Any]]:
        status, doc, _ = await self.call(
            "POST", f"/v1/runs/{run}/kv/set", {"key": key, "value": b64(value)}
        )
        return status, doc


@asynccontextmanager
async def client(url: str, token: str = TOKEN, behind: str | None = None) -> AsyncIterator[Client]:
    headers = {"Authorization": f"Bearer {token}"}
    async with aiohttp.ClientSession(headers=headers) as session:
        yield Client(session, url, behind)


def serve(**quotas: Any) -> Any:
    return serve_in_loop(token=TOKEN, trusted_proxies=["127.0.0.1"], quotas=Quotas(**quotas))


# -- runs made per window and at once -----------------------------------------------------


async def test_a_scoped_token_makes_so_many_runs_per_window(run_id: str) -> None:
    async with serve(max_new_runs=5, new_runs_window=60) as url:
        async with client(url, mint(TOKEN, "team-a-")) as team_a:
            for i in range(5):
                assert (await team_a.kv_set(f"team-a-{run_id}-{i}", "k", b"v"))[0] == 200
            status, doc, headers = await team_a.call(
                "POST", f"/v1/runs/team-a-{run_id}-5/rendezvous", join(1)
            )
            assert status == 429, doc
            assert "the token minted for 'team-a-' made 5 runs in the last 60 s" in doc["error"]
            assert "--max-new-runs" in doc["error"] and "--new-runs-window" in doc["error"]
            assert 50 <= int(headers["Retry-After"]) <= 60
            # Its runs still serve it; nothing was made by the refusal.
            assert (await team_a.kv_set(f"team-a-{run_id}-0", "k2", b"v"))[0] == 200
            assert (await team_a.call("GET", f"/v1/runs/team-a-{run_id}-5"))[0] == 404
        # Another token, and the server's own token on loopback, are not held back.
        async with client(url, mint(TOKEN, "team-b-")) as team_b:
            assert (await team_b.kv_set(f"team-b-{run_id}", "k", b"v"))[0] == 200
        async with client(url) as operator:
            for i in range(20):
                assert (await operator.kv_set(f"{run_id}-op-{i}", "k", b"v"))[0] == 200


async def test_the_window_slides(run_id: str) -> None:
    async with (
        serve(max_new_runs=2, new_runs_window=1.0) as url,
        client(url, behind="10.1.1.1") as c,
    ):
        assert (await c.kv_set(f"{run_id}-1", "k", b"v"))[0] == 200
        assert (await c.kv_set(f"{run_id}-2", "k", b"v"))[0] == 200
        status, doc = await c.kv_set(f"{run_id}-3", "k", b"v")
        assert status == 429 and "client 10.1.1.1 made 2 runs" in doc["error"], doc
        await asyncio.sleep(1.1)
        assert (await c.kv_set(f"{run_id}-3", "k", b"v"))[0] == 200


async def test_a_client_keeps_so_many_runs_at_once(run_id: str) -> None:
    async with (
        serve(max_new_runs=0, max_live_runs=3) as url,
        client(url, behind="10.2.2.2") as c,
        client(url) as operator,
    ):

        async def join_run(run: str, pid: int = 1) -> tuple[int, dict[str, Any], Any]:
            return await c.call("POST", f"/v1/runs/{run}/rendezvous", join(pid))

        for i in range(3):
            assert (await join_run(f"{run_id}-{i}"))[0] == 200
        status, doc, headers = await join_run(f"{run_id}-3")
        assert status == 429 and "Retry-After" not in headers, doc
        assert "client 10.2.2.2 made 3 runs that this server still keeps" in doc["error"]
        assert "--max-live-runs" in doc["error"]
        # A long-poll that would make a run counts too; joins of its runs do not.
        status, doc, _ = await c.call(
            "POST", f"/v1/runs/{run_id}-3/kv/wait", {"keys": ["k"], "timeout": 0}
        )
        assert status == 429, doc
        assert (await join_run(f"{run_id}-0", pid=2))[0] == 200
        # Another client behind the proxy is not held back; a run deleted frees a place.
        async with client(url, behind="10.2.2.3") as other:
            assert (await other.kv_set(f"{run_id}-other", "k", b"v"))[0] == 200
        assert (await operator.call("DELETE", f"/v1/runs/{run_id}-1"))[0] == 200
        assert (await c.kv_set(f"{run_id}-3", "k", b"v"))[0] == 200
        assert (await c.kv_set(f"{run_id}-4", "k", b"v"))[0] == 429


async def test_the_channel_counts_runs_made_too(run_id: str) -> None:
    token = mint(TOKEN, "team-a-")
    async with (
        serve(max_new_runs=1) as url,
        aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as session,
        session.ws_connect(url + "/v1/channel") as ws,
    ):
        answers = []
        # Two nodes join one new run at once: one run made; a second run is one too many.
        runs = [f"team-a-{run_id}", f"team-a-{run_id}", f"team-a-{run_id}-2"]
        for msg_id, run in enumerate(runs, start=1):
            await ws.send_str(json.dumps({"id": msg_id, "run": run, "request": join(msg_id)}))
        for _ in runs:
            answers.append(json.loads((await asyncio.wait_for(ws.receive(), PROMPT)).data))
        by_id = {a["id"]: a for a in answers}
        assert "reply" in by_id[1] and "reply" in by_id[2], answers
        assert by_id[3]["status"] == 429 and "--max-new-runs" in by_id[3]["error"], answers


# -- store bytes --------------------------------------------------------------------------


async def test_a_value_and_a_run_s_store_are_bounded(run_id: str) -> None:
    value = b"x" * 1000
    entry = kv_entry_size("k0", len(value))
    async with serve(max_value=1000, max_run_store=4 * entry) as url, client(url) as c:
        status, doc = await c.kv_set(run_id, "big", value + b"x")
        assert status == 413 and "--max-value-bytes" in doc["error"], doc
        assert "1001 bytes" in doc["error"] and "1000 bytes" in doc["error"]
        status, doc, _ = await c.call(
            "POST",
            f"/v1/runs/{run_id}/kv/compare_set",
            {"key": "cas", "expected": None, "desired": b64(value + b"x")},
        )
        assert status == 413 and "--max-value-bytes" in doc["error"]
        for i in range(4):
            assert (await c.kv_set(run_id, f"k{i}", value))[0] == 200
        status, doc = await c.kv_set(run_id, "k4", value)
        assert status == 413, doc
        assert (
            f"the store of run {run_id!r}" in doc["error"] and "--max-store-bytes" in doc["error"]
        )
        add = {"key": "n", "amount": 1}
        assert (await c.call("POST", f"/v1/runs/{run_id}/kv/add", add))[0] == 413
        # Full, it still takes writes that do not grow it; a delete frees room.
        assert (await c.kv_set(run_id, "k0", b"y" * 1000))[0] == 200
        assert (await c.kv_set(run_id, "k1", b"small"))[0] == 200
        assert (await c.call("POST", f"/v1/runs/{run_id}/kv/add", add))[0] == 200
        body = {"key": "k2"}
        assert (await c.call("POST", f"/v1/runs/{run_id}/kv/delete", body))[2] is not None
        assert (await c.kv_set(run_id, "k4", value))[0] == 200
        status, doc, _ = await c.call("POST", f"/v1/runs/{run_id}/kv/get", {"keys": ["k4", "k2"]})
        assert doc["values"] == [b64(value), None]


async def test_the_stores_of_one_client_and_of_the_server_are_bounded(run_id: str) -> None:
    value = b"x" * 1000
    entry = kv_entry_size("k", len(value))
    quotas = {"max_run_store": 0, "max_client_store": 3 * entry, "max_total_store": 5 * entry}
    async with serve(**quotas) as url:
        async with client(url, mint(TOKEN, "team-a-")) as team_a:
            for i in range(3):
                assert (await team_a.kv_set(f"team-a-{run_id}-{i}", "k", value))[0] == 200
            status, doc = await team_a.kv_set(f"team-a-{run_id}-3", "k", value)
            assert status == 413, doc
            assert "the runs the token minted for 'team-a-' made" in doc["error"]
            assert "--max-client-store-bytes" in doc["error"]
        async with client(url, behind="10.3.3.3") as remote:
            for i in range(2):
                assert (await remote.kv_set(f"{run_id}-r{i}", "k", value))[0] == 200
            status, doc = await remote.kv_set(f"{run_id}-r2", "k", value)
            assert status == 413 and "--max-total-store-bytes" in doc["error"], doc
        async with client(url) as operator:  # the server's limit holds for everyone
            assert (await operator.kv_set(run_id, "k", value))[0] == 413
            assert (await operator.call("DELETE", f"/v1/runs/team-a-{run_id}-0"))[0] == 200
            assert (await operator.kv_set(run_id, "k", value))[0] == 200


# -- abandoned runs -----------------------------------------------------------------------


async def test_abandoned_runs_are_forgotten_and_used_ones_stay(run_id: str) -> None:
    short = Rules(min_nodes=1, max_nodes=2, last_call_ms=10, window_ms=300)
    async with serve(empty_run_ttl=0.5) as url, client(url) as c:

        async def rdzv(run: str, body: dict[str, Any]) -> None:
            status, doc, _ = await c.call("POST", f"/v1/runs/{run}/rendezvous", body)
            assert status == 200 and doc["outcome"] != "error_forbidden", doc

        async def gone(run: str) -> bool:  # (a read of its store would keep it)
            return (await c.call("GET", f"/v1/runs/{run}"))[0] == 404

        abandoned = {name: f"{run_id}-{name}" for name in ("store", "left", "silent", "nothing")}
        await c.kv_set(abandoned["store"], "k", b"v")
        await rdzv(abandoned["left"], join(1))
        await rdzv(abandoned["left"], join(1, Op.LEAVE))
        await c.kv_set(abandoned["silent"], "k", b"v")
        await rdzv(abandoned["silent"], join(1, rules=short))
        await rdzv(abandoned["nothing"], join(1, Op.STATUS))
        kept = {name: f"{run_id}-{name}" for name in ("beating", "read", "waited")}
        await c.kv_set(kept["beating"], "k", b"v")
        await rdzv(kept["beating"], join(1, rules=short))
        await c.kv_set(kept["read"], "k", b"v")

        async def use() -> None:
            while True:
                await rdzv(kept["beating"], join(1, Op.KEEP_ALIVE, rules=short))
                await c.call("POST", f"/v1/runs/{kept['read']}/kv/get", {"keys": ["k"]})
                await asyncio.sleep(0.05)

        user = asyncio.create_task(use())
        wait = {"keys": ["never"], "timeout": 30}
        waiter = asyncio.create_task(c.call("POST", f"/v1/runs/{kept['waited']}/kv/wait", wait))
        try:
            deadline = time.monotonic() + PROMPT
            while not (await gone(abandoned["left"]) and await gone(abandoned["silent"])):
                assert time.monotonic() < deadline, "abandoned runs were not forgotten"
                await asyncio.sleep(0.1)
            # Their stores went with them; the store-only run, quiet longest, went before.
            for run in abandoned.values():
                values = (await c.call("POST", f"/v1/runs/{run}/kv/get", {"keys": ["k"]}))[1]
                assert values["values"] == [None], run
            await asyncio.sleep(1.0)  # twice the TTL more: the used runs stay
            for run in (kept["beating"], kept["read"]):
                values = (await c.call("POST", f"/v1/runs/{run}/kv/get", {"keys": ["k"]}))[1]
                assert values["values"] == [b64(b"v")], run
            listed = (await c.call("GET", "/v1/runs"))[1]["runs"]
            assert [r["run_id"] for r in listed] == [kept["beating"]]
            assert not waiter.done()  # held, and its run kept while it waits
        finally:
            user.cancel()
            waiter.cancel()


# -- what the stores hold, across changes and restarts -------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["set", "add", "cas", "delete", "drop"]),
            st.sampled_from(["a", "b"]),
            st.sampled_from(["k", "key", ""]),
            st.binary(max_size=40),
        ),
        max_size=40,
    )
)
def test_the_engine_counts_what_the_stores_hold(ops: list[tuple[str, str, str, bytes]]) -> None:
    engine = Engine()
    for op, run, key, value in ops:
        if op == "set":
            engine.kv_set(run, key, value)
        elif op == "add":
            with contextlib.suppress(ValueError):
                engine.kv_add(run, key, len(value))
        elif op == "cas":
            engine.kv_compare_set(run, key, engine.kv_get(run, [key])[0], value)
        elif op == "delete":
            engine.kv_delete(run, key)
        else:
            engine.delete(run)
        held = {
            r: sum(kv_entry_size(k, len(v)) for k, v in engine.runs[r].kv.items())
            for r in engine.runs
        }
        assert {r: engine.runs[r].kv_bytes for r in engine.runs} == held
        assert engine.kv_bytes == sum(held.values())


async def test_a_store_s_limit_holds_across_a_restart(tmp_path: Path, run_id: str) -> None:
    value = b"x" * 1000
    entry = kv_entry_size("k0", len(value))
    journal = tmp_path / "runs.json"
    quotas = Quotas(max_run_store=2 * entry)
    server = {"token": TOKEN, "persist_path": journal, "quotas": quotas}
    async with serve_in_loop(**server) as url, client(url) as c:
        assert (await c.kv_set(run_id, "k0", value))[0] == 200
        assert (await c.kv_set(run_id, "k1", value))[0] == 200
    async with serve_in_loop(**server) as url, client(url) as c:
        status, doc = await c.kv_set(run_id, "k2", value)
        assert status == 413 and "--max-store-bytes" in doc["error"], doc
        assert (await c.kv_set(run_id, "k1", b"y" * 1000))[0] == 200


async def test_at_the_limit_of_runs_the_runs_holding_nothing_go_first(run_id: str) -> None:
    async with (
        serve_in_loop(token=TOKEN, max_runs=2) as url,
        client(url) as c,
    ):
        for i in range(2):  # a status asked of runs that do not exist leaves them empty
            status, _, _ = await c.call(
                "POST", f"/v1/runs/{run_id}-{i}/rendezvous", join(1, Op.STATUS)
            )
            assert status == 200
        assert (await c.kv_set(f"{run_id}-full-0", "k", b"v"))[0] == 200
        assert (await c.kv_set(f"{run_id}-full-1", "k", b"v"))[0] == 200
        status, doc = await c.kv_set(f"{run_id}-full-2", "k", b"v")
        assert status == 503 and "--max-runs" in doc["error"], doc


async def test_the_quotas_refusals_are_counted_in_the_metrics(run_id: str) -> None:
    pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    async with serve(max_value=10, max_new_runs=1) as url:
        async with client(url, mint(TOKEN, "team-a-")) as team_a:
            assert (await team_a.kv_set(f"team-a-{run_id}", "k", b"v"))[0] == 200
            assert (await team_a.kv_set(f"team-a-{run_id}", "k", b"v" * 11))[0] == 413
            assert (await team_a.kv_set(f"team-a-{run_id}-2", "k", b"v"))[0] == 429
        async with client(url) as operator, operator.session.get(url + "/metrics") as answer:
            text = await answer.text()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    refused = "aelastic_server_quota_refused_total"
    assert samples[(refused, (("limit", "value"),))] == 1
    assert samples[(refused, (("limit", "new_runs"),))] == 1
    assert samples[(refused, (("limit", "run_store"),))] == 0
    assert samples[("aelastic_server_store_bytes", ())] == kv_entry_size("k", 1)
