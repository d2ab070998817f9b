"""examples/embed_in_service.py: the service keeps answering while it supervises a job."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import importlib.util
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("aiohttp")

import aiohttp
from aiohttp import web

ROOT = Path(__file__).resolve().parents[2]

# Each worker blocks on a shared lock of the gate file, which the test holds exclusively
# until it lets them finish: no sleeps, and no race whichever comes first.
WORKER = """
import fcntl, os, sys
os.write(1, f"worker {os.environ['RANK']} pid {os.getpid()}\\n".encode())
with open(sys.argv[1]) as gate:
    fcntl.flock(gate, fcntl.LOCK_SH)
"""


@contextlib.contextmanager
def _closed_gate(path: Path) -> Iterator[Callable[[], None]]:
    """Hold ``path`` locked; yields a function that opens the gate (releases the lock)."""
    path.touch()
    fp = open(path)  # noqa: SIM115 (closed below)
    fcntl.flock(fp, fcntl.LOCK_EX)
    try:
        yield fp.close
    finally:
        fp.close()


def _load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "embed_in_service", ROOT / "examples" / "embed_in_service.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@dataclass
class Service:
    url: str
    session: aiohttp.ClientSession
    supervisor: Any  # the example's Supervisor: the test waits on its jobs, never sleeps

    async def post_job(self, body: dict[str, Any]) -> Any:
        async with self.session.post(f"{self.url}/jobs", json=body) as resp:
            assert resp.status == 202, await resp.text()
            return self.supervisor.jobs[(await resp.json())["id"]]

    async def get(self, path: str) -> dict[str, Any]:
        async with self.session.get(f"{self.url}{path}") as resp:
            assert resp.status == 200, await resp.text()
            doc: dict[str, Any] = await resp.json()
            return doc


@pytest.fixture
async def service() -> AsyncIterator[Service]:
    example = _load_example()
    app = example.create_app()
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    async with aiohttp.ClientSession() as session:
        try:
            yield Service(url, session, app[example.SUPERVISOR])
        finally:
            await runner.cleanup()  # stops the jobs that are left


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fp:
            return fp.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def _workers_started(job: Any, timeout: float = 60) -> list[int]:
    """Wait (on the agent's events) until the job's workers run; their pids."""
    changed = asyncio.Event()
    remove = job.agent.add_listener(lambda event: changed.set())
    try:
        while not any(e["kind"] == "workers_started" for e in job.events):
            changed.clear()
            await asyncio.wait_for(changed.wait(), timeout)
    finally:
        remove()
    started = [e for e in job.events if e["kind"] == "workers_started"]
    return [int(pid) for pid in started[-1]["pids"].values()]


async def _finished(job: Any, timeout: float = 60) -> None:
    done, _ = await asyncio.wait({job.task}, timeout=timeout)
    assert done, "the job did not finish"


@pytest.mark.anyio
async def test_job_runs_while_the_service_answers(service: Service, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    body = {"nproc": 2, "script": str(script), "args": [str(gate)]}
    with _closed_gate(gate) as open_gate:
        job = await service.post_job(body)
        await _workers_started(job)
        assert (await service.get(f"/jobs/{job.id}"))["state"] == "running"
        # The workers are blocked: the service still answers, quickly.
        started = time.monotonic()
        assert (await service.get("/"))["jobs"] == ["running"]
        assert time.monotonic() - started < 5
        open_gate()  # both workers finish, the job succeeds
        await _finished(job)
    doc = await service.get(f"/jobs/{job.id}")
    assert doc["state"] == "succeeded", doc
    kinds = [e["kind"] for e in doc["events"]]
    assert "rendezvous" in kinds and "workers_started" in kinds


@pytest.mark.anyio
async def test_stopping_a_job_leaves_no_process(service: Service, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    with _closed_gate(gate):
        job = await service.post_job({"nproc": 2, "script": str(script), "args": [str(gate)]})
        pids = await _workers_started(job)
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        async with service.session.delete(f"{service.url}/jobs/{job.id}") as resp:
            doc = await resp.json()
        assert doc["state"] == "stopped"
        assert not [p for p in pids if _alive(p)]


@pytest.mark.anyio
async def test_failed_job_reports_the_root_cause(service: Service, tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text("import sys\nsys.exit(7)\n")
    job = await service.post_job({"script": str(script)})
    await _finished(job)
    doc = await service.get(f"/jobs/{job.id}")
    assert doc["state"] == "failed"
    assert "exitcode 7" in str(doc["root_cause"])


@pytest.mark.anyio
async def test_bad_requests(service: Service) -> None:
    async with service.session.post(f"{service.url}/jobs", json={"nproc": 0}) as resp:
        assert resp.status == 400
    async with service.session.get(f"{service.url}/jobs/99") as resp:
        assert resp.status == 404
