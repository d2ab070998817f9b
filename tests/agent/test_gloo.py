"""Real gloo groups launched by the agent (CPU): a 2-process all-reduce; workers that end
with their group alive."""

from __future__ import annotations

import asyncio
import os
import sys
from asyncio.subprocess import PIPE, STDOUT
from pathlib import Path

import pytest

from aelastic.agent import ElasticAgent, WorkerSpec, WorkerState
from aelastic.agent.health.progress import with_bootstrap
from aelastic.worker._inplace import ENV_SOCKET
from tests._ports import free_port

from ._gloo import all_reduce
from .helpers import make_handler

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.anyio


async def test_gloo_all_reduce(run_id: str) -> None:
    pytest.importorskip("torch.distributed")
    spec = WorkerSpec("trainer", 2, make_handler(run_id), all_reduce, stop_grace_period=5)
    result = await ElasticAgent(spec).run()
    assert result.state is WorkerState.SUCCEEDED, result.failures
    assert result.return_values == {
        0: {"sum": 3.0, "rank": 0, "world": 2, "local_rank": 0},
        1: {"sum": 3.0, "rank": 1, "world": 2, "local_rank": 1},
    }


async def test_workers_that_leave_their_gloo_group_alive_exit_cleanly(
    tmp_path: Path,
) -> None:
    """A gloo group alive at the interpreter's exit aborted the process (SIGABRT,
    "terminate called without an active exception") in about 2 to 6 exits in 10 for a
    group of one made by ``InPlace`` (an in-place survivor left alone), measured on this
    machine. The worker bootstrap destroys it at exit, before the interpreter's
    finalization: checked where the exit handlers run, and by the exits themselves."""
    pytest.importorskip("torch.distributed")
    script = str(Path(__file__).with_name("_gloo.py"))

    async def worker(*args: str) -> tuple[int | None, str]:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "RANK": "0", "LOCAL_RANK": "0"}
        env |= {"WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        env.pop(ENV_SOCKET, None)
        with_bootstrap(env)  # as the agent starts a worker
        proc = await asyncio.create_subprocess_exec(
            sys.executable, script, *args, env=env, stdout=PIPE, stderr=STDOUT, cwd=tmp_path
        )
        out, _ = await asyncio.wait_for(proc.communicate(), 90)
        return proc.returncode, out.decode(errors="replace")

    code, out = await worker("--run-exit-handlers")
    assert code == 0 and "group alive after the exit handlers: False" in out, out
    ends = await asyncio.gather(*(worker() for _ in range(4)))
    assert [code for code, _ in ends] == [0] * 4, ends


async def test_a_gloo_group_destroyed_but_held_in_a_cycle_is_freed_before_the_exit(
    tmp_path: Path,
) -> None:
    """A group the script destroyed, still referred to from a cycle of objects (a model
    wrapped in DDP, a closure), was freed only by the finalization's last collection: its
    thread asking for the GIL then aborted the process (SIGABRT) in 4 of 16 runs of a
    two-rank script under load. The bootstrap collects the cycles at exit while gloo's
    threads run: checked where the exit handlers run, and by the exits themselves."""
    pytest.importorskip("torch.distributed")
    script = str(Path(__file__).with_name("_gloo.py"))

    async def worker(*args: str) -> tuple[int | None, str]:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "RANK": "0", "LOCAL_RANK": "0"}
        env |= {"WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        env.pop(ENV_SOCKET, None)
        with_bootstrap(env)  # as the agent starts a worker
        proc = await asyncio.create_subprocess_exec(
            sys.executable, script, "--destroyed-in-a-cycle", *args, env=env, stdout=PIPE,
            stderr=STDOUT, cwd=tmp_path,
        )  # fmt: skip
        out, _ = await asyncio.wait_for(proc.communicate(), 90)
        return proc.returncode, out.decode(errors="replace")

    code, out = await worker("--run-exit-handlers")
    assert code == 0 and "gloo threads: True" in out, out  # the cycle holds the group
    assert "gloo threads after the exit handlers: False" in out, out
    ends = await asyncio.gather(*(worker() for _ in range(4)))
    assert [code for code, _ in ends] == [0] * 4, ends
