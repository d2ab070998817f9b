"""`aelastic serve` shared by jobs that must not hurt each other: a real server, scoped
tokens, 10,000 run creations and a 500 MiB store fill refused early, the server's memory
bounded, abandoned runs reclaimed, and a real job that still starts afterwards."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import re
import textwrap
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from aelastic.backends.http.server import mint
from aelastic.core.params import Rules
from aelastic.core.state import NodeDesc, Op, Request
from aelastic.core.wire import request_to_json
from tests._http_server import HttpServer
from tests._rendezvous_helpers import PROMPT, SECRET

from ._proc import run_cli

pytest.importorskip("aiohttp")

TOKEN = "operator-t0ken-of-the-shared-server"
MIB = 1 << 20
JOB = """
import os
print(f"worker rank={os.environ['RANK']} of {os.environ['WORLD_SIZE']} ran", flush=True)
"""


def rss(pid: int) -> int:
    """The resident memory of process ``pid``, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for process {pid}")


def run_job(tmp_path: Path, server: HttpServer, run_id: str, token: str) -> str:
    """A real job (one node, one worker) against ``server``: it must start and finish."""
    (tmp_path / "job.py").write_text(textwrap.dedent(JOB))
    args = ["run", "--nnodes", "1", "--rdzv-backend", "http", "--rdzv-endpoint"]
    args += [server.endpoint, "--rdzv-id", run_id, "--local-addr", "127.0.0.1", "job.py"]
    code, out = run_cli(args, tmp_path, env={"AELASTIC_HTTP_TOKEN": token}, timeout=120)
    assert code == 0, out
    assert "worker rank=0 of 1 ran" in out, out
    return out


async def many(count: int, send: Any, parallel: int = 16) -> Counter[int]:
    """``send(session, i)`` for i in range(count), ``parallel`` at a time: the statuses."""
    statuses: Counter[int] = Counter()
    numbers = iter(range(count))

    async def worker(session: aiohttp.ClientSession) -> None:
        for i in numbers:
            statuses[await send(session, i)] += 1

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(worker(session) for _ in range(parallel)))
    return statuses


# -- the command's own flags --------------------------------------------------------------


def test_serve_mints_a_token_from_the_environment_or_a_file(tmp_path: Path) -> None:
    code, out = run_cli(
        ["serve", "--mint-token", "team-a-"], tmp_path, {"AELASTIC_HTTP_TOKEN": TOKEN}
    )
    assert code == 0 and out.strip() == mint(TOKEN, "team-a-"), out
    code, out = run_cli(["serve", "--mint-token", "team-a-"], tmp_path, {"AELASTIC_HTTP_TOKEN": ""})
    assert code == 2 and "--mint-token needs the server's token" in out, out
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    os.chmod(token_file, 0o644)
    args = ["serve", "--token-file", str(token_file), "--mint-token", "team-b-"]
    code, out = run_cli(args, tmp_path, {"AELASTIC_HTTP_TOKEN": ""})
    assert code == 0 and mint(TOKEN, "team-b-") in out, out
    assert "can be read or written by other users" in out and "chmod 600" in out, out
    os.chmod(token_file, 0o600)
    code, out = run_cli(args, tmp_path, {"AELASTIC_HTTP_TOKEN": ""})
    assert code == 0 and out.strip() == mint(TOKEN, "team-b-"), out
    code, out = run_cli(args, tmp_path, {"AELASTIC_HTTP_TOKEN": TOKEN})
    assert code == 2 and "given twice" in out, out


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--max-new-runs", "-1"], "--max-new-runs -1: must be >= 0"),
        (["--new-runs-window", "0"], "--new-runs-window 0: must be a positive number"),
        (["--max-live-runs", "many"], "--max-live-runs many: must be a whole number"),
        (["--empty-run-ttl", "soon"], "--empty-run-ttl soon: must be a number of seconds"),
        (["--max-store-bytes", "64X"], "--max-store-bytes 64X: '64X' is not a byte count"),
        (["--empty-run-ttl", "-5"], "--empty-run-ttl -5: must be >= 0 seconds"),
        (["--scoped-tokens", "/nonexistent"], "--scoped-tokens needs the server's own token"),
        (["--mint-token", ""], "--mint-token: a run-id prefix must be 1 to 256 characters"),
        (["--scoped-tokens", "/nonexistent"], "cannot read the scoped tokens file"),
    ],
)
def test_serve_refuses_bad_quota_flags(tmp_path: Path, flags: list[str], said: str) -> None:
    with_token = "--mint-token" in flags or "cannot read" in said
    env = {"AELASTIC_HTTP_TOKEN": TOKEN if with_token else ""}
    code, out = run_cli(["serve", "--port", "0", *flags], tmp_path, env)
    assert code == 2 and said in out, out


def test_a_listed_token_runs_a_real_job_in_its_runs_only(tmp_path: Path, run_id: str) -> None:
    listed = "team-c-listed-token-0123456789"
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{listed} team-c-\n")
    tokens.chmod(0o600)
    args = ("--scoped-tokens", str(tokens))
    with HttpServer(token=TOKEN, extra_args=args) as server:
        run_job(tmp_path, server, f"team-c-{run_id}", listed)
        (tmp_path / "job.py").write_text(textwrap.dedent(JOB))
        cmd = ["run", "--nnodes", "1", "--rdzv-backend", "http", "--rdzv-endpoint"]
        cmd += [server.endpoint, "--rdzv-id", f"team-d-{run_id}", "job.py"]
        code, out = run_cli(cmd, tmp_path, env={"AELASTIC_HTTP_TOKEN": listed}, timeout=120)
        assert code != 0 and "403" in out and "'team-c-'" in out, out
        assert "worker rank" not in out
        server.stop()
        assert "Traceback" not in server.stderr, server.stderr


# -- a hostile token holder ---------------------------------------------------------------


def test_ten_thousand_run_creations_are_refused_early_and_a_real_job_still_starts(
    tmp_path: Path, run_id: str
) -> None:
    spammer = {"Authorization": f"Bearer {mint(TOKEN, 'team-a-')}"}
    rules = Rules(min_nodes=50, max_nodes=100, last_call_ms=600_000, window_ms=1000)
    args = ("--empty-run-ttl", "2")
    with HttpServer(token=TOKEN, extra_args=args) as server:

        async def create(session: aiohttp.ClientSession, i: int) -> int:
            node = Request(Op.JOIN, NodeDesc("10.0.0.9", i, 0), rules, secret=SECRET)
            url = f"{server.url}/v1/runs/team-a-{run_id}-{i}/rendezvous"
            async with session.post(url, json=request_to_json(node), headers=spammer) as answer:
                if answer.status == 429:
                    doc = await answer.json()
                    assert "--max-new-runs" in doc["error"], doc
                return answer.status

        started = time.monotonic()
        statuses = asyncio.run(many(10_000, create))
        took = time.monotonic() - started
        assert statuses == {200: 60, 429: 10_000 - 60}, statuses
        print(f"10,000 run creations: 60 made, the rest refused in {took:.1f} s")

        # Another team's job starts and runs.
        run_job(tmp_path, server, f"team-b-{run_id}", mint(TOKEN, "team-b-"))

        # The spammer's runs, whose made-up nodes went silent, are reclaimed within seconds.
        async def spam_left() -> list[str]:
            async with (
                aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as s,
                s.get(f"{server.url}/v1/runs") as answer,
            ):
                runs = (await answer.json())["runs"]
            return [r["run_id"] for r in runs if r["run_id"].startswith("team-a-")]

        deadline = time.monotonic() + 3 + PROMPT
        while left := asyncio.run(spam_left()):
            assert time.monotonic() < deadline, f"{len(left)} abandoned runs are still kept"
            time.sleep(0.2)
        server.stop()
        assert "Traceback" not in server.stderr, server.stderr


def test_a_500_mib_store_fill_is_refused_early_and_the_memory_stays_bounded(
    tmp_path: Path, run_id: str
) -> None:
    team_a = {"Authorization": f"Bearer {mint(TOKEN, 'team-a-')}"}
    big = base64.b64encode(b"x" * (5 * MIB // 2)).decode()
    one_mib = base64.b64encode(b"y" * MIB).decode()
    args = ("--max-client-store-bytes", "128M")
    with HttpServer(token=TOKEN, extra_args=args) as server:
        before = rss(server.pid)

        def kv_set(run: str, key: str, value: str) -> Any:
            async def send(session: aiohttp.ClientSession, i: int) -> int:
                url = f"{server.url}/v1/runs/{run.format(i=i, j=i // 10)}/kv/set"
                body = json.dumps({"key": key.format(i=i), "value": value}).encode()
                headers = {**team_a, "Content-Type": "application/json"}
                async with session.post(url, data=io.BytesIO(body), headers=headers) as answer:
                    if answer.status != 200:
                        refusals[(await answer.json())["error"].split("(")[-1]] += 1
                    return answer.status

            return send

        refusals: Counter[str] = Counter()
        # The attack as it was: 200 values of 2.5 MiB. Each is over the limit of a value.
        statuses = asyncio.run(many(200, kv_set(f"team-a-{run_id}", "v{i}", big), parallel=4))
        assert statuses == {413: 200}, statuses
        assert set(refusals) == {"aelastic serve --max-value-bytes)"}, refusals
        # 500 values of 1 MiB into one run: the run's store stops at 64 MiB.
        refusals.clear()
        fill = kv_set(f"team-a-{run_id}", "k{i}", one_mib)
        statuses = asyncio.run(many(500, fill, parallel=4))
        assert statuses[200] == 63 and statuses[413] == 500 - 63, statuses
        assert set(refusals) == {
            "aelastic serve --max-store-bytes): delete keys it no longer needs"
        }
        # 500 more spread over 50 runs: the team's stores stop at its limit (128 MiB).
        refusals.clear()
        spread = kv_set(f"team-a-{run_id}-{{j}}", "k{i}", one_mib)
        statuses = asyncio.run(many(500, spread, parallel=4))
        assert statuses[200] <= 64 and statuses[413] == 500 - statuses[200], statuses
        assert set(refusals) == {
            "aelastic serve --max-client-store-bytes): delete keys or runs it no longer needs"
        }, refusals
        grown = rss(server.pid) - before
        print(f"1.5 GB of writes: 128 MiB kept, the server's memory grew {grown / MIB:.0f} MiB")
        assert grown < 128 * MIB + 96 * MIB, f"the server grew {grown / MIB:.0f} MiB"

        run_job(tmp_path, server, f"team-b-{run_id}", mint(TOKEN, "team-b-"))
        assert rss(server.pid) - before < 128 * MIB + 96 * MIB
        server.stop()
        assert "Traceback" not in server.stderr, server.stderr
        assert not re.search(r"\bERROR\b", server.stderr), server.stderr
