"""A persisting ``aelastic serve`` holding 20,000 runs stays responsive while it writes.

Every write appends the changed runs to a journal off the event loop (never a rewrite of all
runs per write), so ``/health`` answers quickly while runs keep changing. The bound checked
here is generous (shared 2-core machines); the measured figure is printed.
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from tests._http_server import free_port

pytestmark = pytest.mark.anyio

RUNS = 20_000
VALUE = {"key": "k", "value": "dmFsdWU="}  # base64 "value"


async def _write(session: aiohttp.ClientSession, url: str, runs: range) -> None:
    for n in runs:
        async with session.post(f"{url}/v1/runs/load-{n}/kv/set", json=VALUE) as answer:
            assert answer.status == 200, await answer.text()


async def test_health_answers_quickly_while_20000_persisted_runs_change(tmp_path: Path) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "aelastic", "serve", "--port", str(port)]
    cmd += ["--persist", str(tmp_path / "runs.json"), "--max-runs", str(2 * RUNS)]
    # Started before the loop has work: a blocking start is fine here.
    server = subprocess.Popen(  # noqa: ASYNC220
        cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        assert server.stdout is not None
        assert "listening on" in server.stdout.readline()
        connector = aiohttp.TCPConnector(limit=64)
        async with aiohttp.ClientSession(connector=connector) as session:
            lanes = 32
            await asyncio.gather(
                *(_write(session, url, range(i, RUNS, lanes)) for i in range(lanes))
            )
            # Runs keep changing (and being written) while /health is probed.
            writers = asyncio.gather(
                *(_write(session, url, range(i, RUNS // 4, 8)) for i in range(8))
            )
            latencies: list[float] = []
            async with aiohttp.ClientSession() as probe:
                while not writers.done():
                    started = time.perf_counter()
                    async with probe.get(f"{url}/v1/health") as answer:
                        assert answer.status == 200
                    latencies.append(time.perf_counter() - started)
                    await asyncio.sleep(0.01)
            await writers
    finally:
        server.terminate()
        server.communicate(timeout=30)
    assert len(latencies) >= 10
    worst, median = max(latencies), statistics.median(latencies)
    print(
        f"/health with {RUNS} persisted runs changing: median {median * 1000:.1f} ms, "
        f"max {worst * 1000:.1f} ms over {len(latencies)} probes"
    )
    assert median < 0.2 and worst < 2.0  # generous: the loop is never blocked for long
    journal = (tmp_path / "runs.json").stat().st_size
    assert journal > 0
