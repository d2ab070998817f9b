"""torch's ``test/distributed/elastic/agent/server/test/local_elastic_agent_test.py``, the
scenarios that kill an agent: ``double_agent_elastic`` (a job of one to two nodes loses one
and goes on) and ``double_agent_fault_tolerance`` (a job of two nodes loses one, a new node
takes its place). The agents are real processes (``python -m aelastic run``) on each backend
that nodes on several machines can share (Redis, HTTP, etcd, and ``c10d`` hosted by an agent
of the session: a killed node is never the host, as in torch's test where the killed agent
is not the one of ``is_host``); the memory backend lives in one process.

Ported: those 2 scenarios.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from ._agents import WORKER, worker_envs, written

pytestmark = pytest.mark.anyio

SHARED = ["redis", "http", "etcd", "c10d"]
#: Short heartbeats: a killed agent is seen gone within 2 s (a window of 0.4 s had an agent
#: that the loaded machine left unscheduled for 0.2 s dropped).
CONF = "keep_alive_interval=0.5,keep_alive_max_attempt=4,last_call_timeout=0.2,join_timeout=30"


@pytest.fixture(params=SHARED)
def shared(request: pytest.FixtureRequest) -> tuple[str, str]:
    """(backend, endpoint) of a backend that agent processes share."""
    name: str = request.param
    return name, request.getfixturevalue(f"{name}_url")


class Agents:
    """Agent processes of one job; every one still running is killed at the end."""

    def __init__(self, backend: str, endpoint: str, run_id: str) -> None:
        self.backend, self.endpoint, self.run_id = backend, endpoint, run_id
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(
        self, nnodes: str, out: Path, *worker: str, max_restarts: int = 2
    ) -> subprocess.Popen[bytes]:
        conf = CONF + (",is_host=false" if self.backend == "c10d" else "")
        argv = [
            sys.executable, "-m", "aelastic", "run", "-q", "--no-warm-standby",
            f"--nnodes={nnodes}", "--nproc-per-node=1", f"--rdzv-backend={self.backend}",
            f"--rdzv-endpoint={self.endpoint}", f"--rdzv-id={self.run_id}", f"--rdzv-conf={conf}",
            f"--max-restarts={max_restarts}", "--exit-barrier-timeout=5",
            WORKER, str(out), *worker,
        ]  # fmt: skip
        out.mkdir(exist_ok=True)
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            if proc.stderr is not None:
                proc.stderr.close()


@pytest.fixture
def agents(shared: tuple[str, str], run_id: str) -> Iterator[Agents]:
    job = Agents(*shared, run_id)
    yield job
    job.stop_all()


async def until_world(out: Path, size: str, within: float = 60.0) -> None:
    """Wait until a worker of ``out`` ran in a world of ``size``."""
    with anyio.fail_after(within):
        for _ in range(int(within / 0.02) + 2):
            if any(env["WORLD_SIZE"] == size for env in worker_envs(out).values()):
                return
            await anyio.sleep(0.02)


async def _exit_code(proc: subprocess.Popen[bytes], within: float = 60.0) -> int:
    with anyio.fail_after(within):
        while proc.poll() is None:  # noqa: ASYNC110 (a child process: nothing to await)
            await anyio.sleep(0.05)
    return proc.returncode


def _stderr(proc: subprocess.Popen[bytes]) -> str:
    assert proc.stderr is not None
    return proc.stderr.read().decode(errors="replace")[-3000:]


async def test_double_agent_elastic(agents: Agents, tmp_path: Path) -> None:
    """Two agents of a 1:2 job; one is killed (SIGKILL); the other goes on alone and
    succeeds (its workers end only in a world of one, once told to)."""
    go = tmp_path / "go"
    outs = [tmp_path / "a", tmp_path / "b"]
    procs = [agents.start("1:2", out, "alone_after", str(go)) for out in outs]
    for out in outs:  # both in the round of two
        await until_world(out, "2")
    procs[1].kill()
    assert await _exit_code(procs[1]) == -signal.SIGKILL
    go.touch()
    code = await _exit_code(procs[0])
    assert code == 0, _stderr(procs[0])


async def test_double_agent_fault_tolerance(agents: Agents, tmp_path: Path) -> None:
    """Two agents of a 2-node job; one is killed and a new one started: the job goes on
    with the new node and both succeed."""
    go = tmp_path / "go"
    outs = [tmp_path / "a", tmp_path / "b", tmp_path / "c"]
    first, doomed = (agents.start("2", out, "until_file", str(go)) for out in outs[:2])
    for out in outs[:2]:
        await written(out, 1)
    doomed.kill()
    assert await _exit_code(doomed) == -signal.SIGKILL
    replacement = agents.start("2", outs[2], "until_file", str(go))
    await written(outs[2], 1)
    go.touch()
    for proc in (first, replacement):
        code = await _exit_code(proc)
        assert code == 0, _stderr(proc)
