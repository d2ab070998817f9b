"""A worker that outlives SIGKILL: a real process in uninterruptible sleep (a read on a FUSE
mount served by the test and frozen). Its agent waits the bound, reports pid, state and
wait channel, leaves the rendezvous and ends; the other node goes on without it."""

from __future__ import annotations

import asyncio
import ctypes
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from aelastic.agent import ElasticAgent, UnkillableWorkers, WorkerState
from aelastic.agent.processes.unkillable import (
    TIMEOUT_VAR,
    WorkersUnkillable,
    reap_kept,
    unkillable_bound,
)

from .helpers import make_handler
from .test_heal import heal_spec, recorder, started

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]

FUSE_SERVER = str(Path(__file__).with_name("_fuse.py"))
_MNT_DETACH = 2


@pytest.fixture
def frozen_file(tmp_path: Path) -> Iterator[str]:
    """A file whose reads never return (a frozen FUSE server, stopped afterwards)."""
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    server = subprocess.Popen(
        [sys.executable, FUSE_SERVER, str(mountpoint)], stdout=subprocess.PIPE, text=True
    )
    assert server.stdout is not None
    first = server.stdout.readline().strip()
    try:
        if first != "mounted":
            pytest.skip(f"no FUSE mount on this machine (needs /dev/fuse and root): {first}")
        yield str(mountpoint / "frozen")
    finally:
        server.kill()  # aborts the connection: the frozen reader dies
        server.wait()
        server.stdout.close()
        ctypes.CDLL(None, use_errno=True).umount2(str(mountpoint).encode(), _MNT_DETACH)


def test_the_bound_is_torchs_variable_else_the_grace() -> None:
    assert unkillable_bound(30.0, {TIMEOUT_VAR: "2.5"}) == 2.5
    assert unkillable_bound(30.0, {}) == 30.0
    assert unkillable_bound(0.0, {TIMEOUT_VAR: "0"}) == 5.0  # torch: <= 0 disables it
    assert unkillable_bound(8.0, {TIMEOUT_VAR: "soon"}) == 8.0


async def test_an_unkillable_worker_is_reported_and_its_node_leaves_the_job(
    run_id: str,
    tmp_path: Path,
    return_survivor: list[int],
    frozen_file: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(TIMEOUT_VAR, "1")
    conf = {"last_call_timeout": 1.0, "keep_alive_interval": 0.5}
    good = ElasticAgent(
        heal_spec(
            make_handler(run_id, 1, 2, local_addr="127.0.0.1", **conf), tmp_path, "until_alone"
        )
    )
    stuck = ElasticAgent(
        heal_spec(
            make_handler(run_id, 1, 2, local_addr="127.0.0.2", **conf),
            tmp_path,
            "frozen",
            frozen_file,
            nproc=2,
            stop_grace_period=0.5,
        )
    )
    events = recorder(stuck)
    async with started(good, stuck) as (task_good, task_stuck):
        with pytest.raises(WorkersUnkillable) as caught:
            await asyncio.wait_for(task_stuck, 60)
        left_at = time.monotonic()
        result = await asyncio.wait_for(task_good, 60)  # the other node goes on alone
    assert result.state is WorkerState.SUCCEEDED
    [survivor] = caught.value.survivors
    assert survivor.local_rank == 1 and survivor.state.startswith("D")
    assert survivor.wchan != "?"  # the kernel function it waits in (request_wait_answer)
    [event] = [e for e in events if isinstance(e, UnkillableWorkers)]
    assert event.pids == (survivor.pid,) and event.bound == 1.0
    assert f"pid {survivor.pid}" in event.details[0] and "state D" in event.details[0]
    snapshot = await good.spec.rdzv_handler.backend.snapshot()
    assert snapshot is not None
    assert all(e.node.addr != "127.0.0.2" for e in snapshot.members())  # it left
    assert time.monotonic() - left_at < 30
    # Still there, until the server goes.
    with open(f"/proc/{survivor.pid}/status") as f:  # noqa: ASYNC230 - /proc, no disk
        assert "State:\tD" in f.read()
    return_survivor.append(survivor.pid)


@pytest.fixture
def return_survivor() -> Iterator[list[int]]:
    """Pids given up on: reaped once the frozen server is gone (the fixture ends first)."""
    pids: list[int] = []
    yield pids
    deadline = time.monotonic() + 30
    while reap_kept() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in pids if os.path.exists(f"/proc/{pid}")]
