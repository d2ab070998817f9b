"""``aelastic status --list``: the runs on a real HTTP server and a real Redis, one line each."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from pathlib import Path

import pytest

from aelastic import RendezvousParameters
from aelastic.backends import create_backend
from aelastic.core.state import NodeDesc, Op, Request
from aelastic.rendezvous import RendezvousSettings
from tests._rendezvous_helpers import SECRET

from ._proc import run_cli

pytest.importorskip("aiohttp")


def _make_runs(backend: str, endpoint: str, runs: dict[str, int]) -> None:
    """Each run of ``runs`` gets that many nodes (of 2 to 3: two complete the round)."""

    async def make() -> None:
        for run_id, count in runs.items():
            params = RendezvousParameters(backend, endpoint, run_id, 2, 3, last_call_timeout=0.05)
            made = create_backend(params)
            try:
                rules = RendezvousSettings.from_parameters(params).rules
                nodes = [NodeDesc("10.0.0.9", 100 + pid, 0) for pid in range(count)]
                for node in nodes:
                    await made.apply(Request(Op.JOIN, node, rules, secret=SECRET))
                await asyncio.sleep(0.2)  # past the last call: the next join completes
                await made.apply(Request(Op.JOIN, nodes[-1], rules, secret=SECRET))
            finally:
                await made.aclose()

    asyncio.run(make())


def _list(tmp_path: Path, backend: str, endpoint: str, *extra: str) -> tuple[int, str]:
    args = ["status", "--list", "--rdzv-backend", backend, "--rdzv-endpoint", endpoint]
    return run_cli([*args, *extra], tmp_path)


def test_status_list_names_the_runs_of_an_http_server(tmp_path: Path, run_id: str) -> None:
    from tests._http_server import HttpServer

    with HttpServer() as server:
        code, out = _list(tmp_path, "http", server.endpoint)
        assert code == 0 and out.strip() == f"no runs at {server.url}", out
        _make_runs("http", server.endpoint, {f"{run_id}-a": 1, f"{run_id}-b": 2})
        code, out = _list(tmp_path, "http", server.endpoint)
        assert code == 0, out
        lines = out.strip().splitlines()
        assert lines[0].split() == ["RUN", "ROUND", "STATE", "MEMBERS", "WAITING", "REDUNDANT"]
        assert re.fullmatch(rf"{run_id}-a +0 +forming +1 +0 +0", lines[1]), lines
        assert re.fullmatch(rf"{run_id}-b +0 +complete +2 of 2 +0 +0", lines[2]), lines
        code, out = _list(tmp_path, "http", server.endpoint, "--json")
        assert code == 0, out
        doc = json.loads(out)
        assert doc["more"] is False
        assert [(r["run_id"], r["state"], r["participants"]) for r in doc["runs"]] == [
            (f"{run_id}-a", "forming", 1),
            (f"{run_id}-b", "complete", 2),
        ]
        code, out = _list(tmp_path, "http", server.endpoint, "--limit", "1")
        assert code == 0 and len(out.strip().splitlines()) == 3, out
        assert "more runs exist than the 1 listed" in out


def test_status_list_names_the_runs_in_redis(tmp_path: Path, run_id: str) -> None:
    pytest.importorskip("redis")
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    from tests._redis_server import RedisServer

    with RedisServer() as redis:
        _make_runs("redis", redis.url, {run_id: 2, "{braced}": 1})
        code, out = _list(tmp_path, "redis", redis.url, "--json")
        assert code == 0, out
        runs = {r["run_id"]: r for r in json.loads(out)["runs"]}
        assert runs[run_id]["state"] == "complete" and runs[run_id]["world"] == 2
        (braced,) = (r for r in runs if r.startswith("sha1-"))  # an id with braces: its tag
        assert runs[braced]["participants"] == 1


def test_status_list_bad_input(tmp_path: Path) -> None:
    code, out = _list(tmp_path, "memory", "x")
    assert code == 2 and out.count("\n") == 0 and "memory backend" in out, out
    code, out = _list(tmp_path, "http", "127.0.0.1:1", "--watch")
    assert code == 2 and "--list cannot be combined" in out, out
    code, out = run_cli(["status", "--rdzv-backend", "http", "--rdzv-endpoint", "x:1"], tmp_path)
    assert code == 2 and "--rdzv-id is required" in out, out
