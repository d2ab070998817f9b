"""The agent on one node, with real worker processes (``worker.py``)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from aelastic.agent import AgentEvent, ElasticAgent, EventKind, WorkerState
from aelastic.agent.health.errors import NOT_KEPT, error_details, format_failures
from aelastic.agent.processes import standby

from .helpers import (
    WorkerHub,
    children,
    make_handler,
    not_running,
    own_dir,
    reaped,
    running,
    worker_spec,
)

pytestmark = pytest.mark.anyio

#: The warm standby's program, as it shows in ``sys.orig_argv``.
STANDBY = str(Path(standby.__file__).with_name("_standby.py"))

TORCH_NAMES = (
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "LOCAL_WORLD_SIZE",
    "WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
)


async def test_worker_environment_is_torchs(run_id: str, tmp_path: Any) -> None:
    handler = make_handler(run_id)
    async with WorkerHub() as hub:
        spec = worker_spec(
            handler, hub, "env", 2, "--lr=${local_rank}", max_restarts=2, log_dir=str(tmp_path)
        )
        async with running(ElasticAgent(spec)) as task:
            hellos = await hub.gather(2)
            for hello in hellos:
                hub.release(hello["pid"])
            result = await task
    assert result.state is WorkerState.SUCCEEDED
    ports = {h["env"]["MASTER_PORT"] for h in hellos}
    assert len(ports) == 1
    for local_rank, hello in enumerate(hellos):
        env = hello["env"]
        expected = {
            "RANK": str(local_rank),
            "LOCAL_RANK": str(local_rank),
            "GROUP_RANK": "0",
            "ROLE_RANK": str(local_rank),
            "ROLE_NAME": "trainer",
            "LOCAL_WORLD_SIZE": "2",
            "WORLD_SIZE": "2",
            "GROUP_WORLD_SIZE": "1",
            "ROLE_WORLD_SIZE": "2",
            "MASTER_ADDR": handler.node.addr,
            "MASTER_PORT": ports.pop() if local_rank == 0 else env["MASTER_PORT"],
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "2",
            "TORCHELASTIC_RUN_ID": run_id,
            "TORCHELASTIC_USE_AGENT_STORE": "False",
            "TORCHELASTIC_ERROR_FILE": str(
                own_dir(tmp_path, run_id) / "attempt_0" / str(local_rank) / "error.json"
            ),
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get(
                "TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"
            ),
        }
        assert {k: env.get(k) for k in TORCH_NAMES} == expected
        assert int(env["MASTER_PORT"]) > 0
        assert env["OMP_NUM_THREADS"] == os.environ.get("OMP_NUM_THREADS", "1")
        assert env["AELASTIC_TEST_HUB"] == hub.env["AELASTIC_TEST_HUB"]
        # Exactly the agent's environment plus the contract (Python may add LC_CTYPE), and
        # the agent's in-place recovery socket, beat page and progress page (paths in
        # private directories).
        known = set(os.environ) | set(expected) | {"OMP_NUM_THREADS", "AELASTIC_TEST_HUB"}
        ours = {"AELASTIC_INPLACE_SOCKET", "AELASTIC_AGENT_BEAT", "AELASTIC_PROGRESS_FILE"}
        assert set(env) - known <= {"LC_CTYPE", *ours}
        assert "aelastic-inplace-" in env.get("AELASTIC_INPLACE_SOCKET", "aelastic-inplace-")
        assert "aelastic-progress-" in env["AELASTIC_PROGRESS_FILE"]  # hangs watched by default
        assert "aelastic-beat-" in env.get("AELASTIC_AGENT_BEAT", "aelastic-beat-")
        assert all(env[k] == v for k, v in os.environ.items() if k not in expected)
        assert hello["argv"] == ["env", f"--lr={local_rank}"]


async def test_warm_restart_looks_like_a_cold_start(run_id: str, tmp_path: Any) -> None:
    handler = make_handler(run_id)
    async with WorkerHub() as hub:
        spec = worker_spec(handler, hub, "env", 2, "--lr=${local_rank}", max_restarts=1)
        agent = ElasticAgent(spec)
        ready = asyncio.Event()
        agent.add_listener(lambda e: e.kind is EventKind.STANDBYS_READY and ready.set())
        async with running(agent) as task:
            cold = await hub.gather(2)
            await asyncio.wait_for(ready.wait(), 30)
            hub.tell(cold[0]["pid"], "exit 1")
            warm = await hub.gather(2)
            for hello in warm:
                hub.release(hello["pid"])
            assert (await task).state is WorkerState.SUCCEEDED
    for before, after in zip(cold, warm, strict=True):
        assert STANDBY not in before["orig_argv"] and STANDBY in after["orig_argv"]  # warm
        assert after["main"] == before["main"]
        assert after["argv"] == before["argv"]
        changed = {
            "TORCHELASTIC_RESTART_COUNT",
            "MASTER_PORT",
            "TORCHELASTIC_ERROR_FILE",
            "AELASTIC_PROGRESS_FILE",  # the attempt's page
        }
        same = {k: v for k, v in before["env"].items() if k not in changed}
        assert {k: v for k, v in after["env"].items() if k not in changed} == same
        assert after["env"]["TORCHELASTIC_RESTART_COUNT"] == "1"
        assert after["env"]["TORCHELASTIC_ERROR_FILE"].endswith(
            f"attempt_1/{before['local_rank']}/error.json"
        )


async def test_crash_restarts_the_group(run_id: str, tmp_path: Any) -> None:
    handler = make_handler(run_id)
    async with WorkerHub() as hub:
        spec = worker_spec(handler, hub, "report", 2, max_restarts=1, log_dir=str(tmp_path))
        async with running(ElasticAgent(spec)) as task:
            first = await hub.gather(2)
            assert [h["restart"] for h in first] == [0, 0]
            hub.tell(first[1]["pid"], "exit 3")
            second = await hub.gather(2)
            assert [h["restart"] for h in second] == [1, 1]
            assert [h["world_size"] for h in second] == [2, 2]
            # The whole first attempt was stopped and reaped before the second started.
            assert all(reaped(h["pid"]) for h in first)
            for hello in second:
                hub.release(hello["pid"])
            result = await task
    assert result.state is WorkerState.SUCCEEDED
    assert result.failures == {}
    assert (own_dir(tmp_path, run_id) / "attempt_0" / "1").is_dir()
    assert (own_dir(tmp_path, run_id) / "attempt_1" / "1").is_dir()


@pytest.mark.parametrize("keep", [True, False], ids=["log_dir", "temporary_logs"])
async def test_restarts_exhausted_fail_with_the_root_cause(
    run_id: str, tmp_path: Path, keep: bool
) -> None:
    handler = make_handler(run_id)
    async with WorkerHub() as hub:
        log_dir = str(tmp_path) if keep else None
        spec = worker_spec(handler, hub, "report", 2, max_restarts=1, log_dir=log_dir)
        async with running(ElasticAgent(spec)) as task:
            for attempt in range(2):
                hellos = await hub.gather(2)
                hub.tell(hellos[1]["pid"], f"raise boom-{attempt}")
            result = await task
    assert result.state is WorkerState.FAILED
    assert result.is_failed()
    assert set(result.failures) == {1}
    failure = result.root_cause
    assert failure is not None
    assert failure.global_rank == 1 and failure.local_rank == 1
    assert failure.pid == hellos[1]["pid"]
    assert failure.exitcode == 1
    assert failure.message == "RuntimeError: boom-1"
    if keep:  # the error file is still there, with what the report says
        assert failure.error_file.endswith("attempt_1/1/error.json")
        with open(failure.error_file) as fp:  # noqa: ASYNC230 - a small local file
            assert json.load(fp) == failure.error_file_data
    else:  # the temporary logs are gone: no dead path, the content is in the failure
        assert failure.error_file == NOT_KEPT
        assert "boom-1" in error_details(failure)
        assert "error_file: <not kept" in format_failures(result)
    assert "py_callstack" in failure.error_file_data["message"]["extraInfo"]
    assert abs(failure.timestamp - time.time()) < 60
    assert all(reaped(h["pid"]) for h in hellos)


async def test_killed_worker_reports_the_signal(run_id: str) -> None:
    handler = make_handler(run_id)
    async with WorkerHub() as hub:
        spec = worker_spec(handler, hub, "report", 2)
        async with running(ElasticAgent(spec)) as task:
            hellos = await hub.gather(2)
            os.kill(hellos[0]["pid"], signal.SIGKILL)
            result = await task
    failure = result.failures[0]
    assert failure.exitcode == -signal.SIGKILL
    assert failure.signal_name() == "SIGKILL"
    assert f"Signal 9 (SIGKILL) received by PID {hellos[0]['pid']}" == failure.message
    assert failure.error_file == "<N/A>"


async def test_worker_ignoring_sigterm_is_killed_after_the_grace(run_id: str) -> None:
    handler = make_handler(run_id)
    grace = 0.5
    async with WorkerHub() as hub:
        spec = worker_spec(handler, hub, "ignore_term", 2, stop_grace_period=grace)
        async with running(ElasticAgent(spec)) as task:
            hellos = await hub.gather(2)
            started = time.monotonic()
            hub.tell(hellos[0]["pid"], "exit 1")
            result = await task
            elapsed = time.monotonic() - started
    assert result.state is WorkerState.FAILED and set(result.failures) == {0}
    assert elapsed >= grace
    assert elapsed < grace + 20
    assert reaped(hellos[1]["pid"])


async def test_cancelling_run_leaves_nothing_running(run_id: str) -> None:
    handler = make_handler(run_id, min_nodes=1, max_nodes=2)
    events: list[Any] = []
    async with WorkerHub() as hub:
        before = children()
        agent = ElasticAgent(worker_spec(handler, hub, "grandchild", 2))
        agent.add_listener(events.append)
        ready = asyncio.Event()
        agent.add_listener(lambda e: e.kind is EventKind.STANDBYS_READY and ready.set())
        async with running(agent) as task:
            hellos = await hub.gather(2)
            await asyncio.wait_for(ready.wait(), 30)
            during = children()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            after = children()
    # Workers, standbys and the guardian helper were this process's children; none is left.
    assert [c for c in during.values() if c.endswith("_guard.py")], during
    assert after.items() <= before.items(), after
    for hello in hellos:
        assert reaped(hello["pid"]), hello
        assert not_running(hello["grandchild"]), hello
    standbys = next(e for e in events if e.kind is EventKind.STANDBYS_READY).data["pids"]
    assert len(standbys) == 2 and all(reaped(pid) for pid in standbys.values())
    state = await handler.backend.snapshot()
    assert state is not None
    assert handler.node not in state.ranks()
    assert not state.status.closed  # leaving is not closing
    assert events[-1].kind is EventKind.FINISHED
    await handler.aclose()


async def test_cancel_during_rendezvous(run_id: str) -> None:
    handler = make_handler(run_id, min_nodes=2, max_nodes=2)
    async with WorkerHub() as hub:
        agent = ElasticAgent(worker_spec(handler, hub))
        async with handler.events() as transitions, running(agent) as task:
            await asyncio.wait_for(transitions.get(), 30)  # joined, waiting for a peer
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
    state = await handler.backend.snapshot()
    assert state is not None and not state.knows(handler.node)
    await handler.aclose()


def _square(x: int) -> int:
    return x * x + int(os.environ["RANK"])


def _raise(message: str) -> None:
    raise ValueError(message)


async def test_callable_entrypoint_returns_values(run_id: str) -> None:
    handler = make_handler(run_id)
    spec = worker_spec(handler, WorkerHub(), nproc=2)
    spec.entrypoint, spec.args = _square, (3,)
    result = await ElasticAgent(spec).run()
    assert result.state is WorkerState.SUCCEEDED
    assert result.return_values == {0: 9, 1: 10}


async def test_callable_exception_lands_in_the_failure(run_id: str) -> None:
    handler = make_handler(run_id)
    spec = worker_spec(handler, WorkerHub(), nproc=1)
    spec.entrypoint, spec.args = _raise, ("bad input",)
    result = await ElasticAgent(spec).run()
    assert result.state is WorkerState.FAILED
    assert result.failures[0].message == "ValueError: bad input"
    assert result.failures[0].exitcode == 1


async def test_run_sync_from_a_thread_while_a_loop_runs(run_id: str) -> None:
    handler = make_handler(run_id)
    spec = worker_spec(handler, WorkerHub(), nproc=2)
    spec.entrypoint, spec.args = _square, (2,)
    agent = ElasticAgent(spec)
    result = await asyncio.to_thread(agent.run_sync)
    assert result.return_values == {0: 4, 1: 5}
    with pytest.raises(RuntimeError, match="await run"):
        ElasticAgent(spec).run_sync()
    with pytest.raises(RuntimeError, match="runs once"):
        await agent.run()


async def test_missing_command_raises_and_leaves(run_id: str) -> None:
    handler = make_handler(run_id)
    spec = worker_spec(handler, WorkerHub(), nproc=2)
    spec.entrypoint = "/nonexistent/aelastic-worker"
    with pytest.raises(FileNotFoundError):
        await ElasticAgent(spec).run()
    state = await handler.backend.snapshot()
    assert state is not None and not state.knows(handler.node)
    await handler.aclose()


async def test_events_and_metrics(run_id: str) -> None:
    handler = make_handler(run_id)
    async with WorkerHub() as hub:
        agent = ElasticAgent(worker_spec(handler, hub, "report", 1, max_restarts=1))
        seen: list[Any] = []
        agent.add_listener(seen.append)
        stream = agent.events()

        async def collect() -> list[Any]:
            return [event async for event in stream]

        collector = asyncio.ensure_future(collect())
        async with running(agent) as task:
            hub.tell((await hub.next())["pid"], "exit 2")
            hub.release((await hub.next())["pid"])
            await task
        streamed = await asyncio.wait_for(collector, 30)
    assert streamed == seen
    seen = [e for e in seen if isinstance(e, AgentEvent)]  # the agent's, not the handler's
    kinds = [e.kind for e in seen]
    assert kinds[0] is EventKind.RENDEZVOUS
    assert kinds.count(EventKind.RENDEZVOUS) == 2
    assert kinds.count(EventKind.WORKERS_STARTED) == 2
    assert kinds[-2:] == [EventKind.EXIT_BARRIER, EventKind.FINISHED]
    exits = [e.data for e in seen if e.kind is EventKind.WORKER_EXITED]
    assert [d["exitcode"] for d in exits] == [2, 0]
    restart = next(e for e in seen if e.kind is EventKind.RESTART)
    assert restart.data["spent"] is True and restart.data["restarts_left"] == 0
    started = [e for e in seen if e.kind is EventKind.WORKERS_STARTED]
    assert started[0].recovery is None and started[1].data["recovery"] >= 0
    assert [e.round for e in started] == [e.round for e in seen if e.kind is EventKind.RENDEZVOUS]
    assert started[1].round == started[0].round + 1 and started[0].node == str(handler.node)
    assert started[1].restart_count == 1 and started[1].attempt == 1
    states = [e.state for e in seen if e.kind is EventKind.STATE_CHANGED]
    assert states == [
        WorkerState.HEALTHY,
        WorkerState.FAILED,
        WorkerState.INIT,
        WorkerState.HEALTHY,
        WorkerState.SUCCEEDED,
    ]
    metrics = agent.metrics
    assert metrics.rendezvous_count == 2 and metrics.restarts == 1 and metrics.rescales == 0
    assert metrics.worker_starts == 2 and metrics.last_recovery_duration is not None


async def test_cancel_during_a_stop_waits_for_the_stop(run_id: str) -> None:
    handler = make_handler(run_id)
    async with WorkerHub() as hub:
        agent = ElasticAgent(worker_spec(handler, hub, "ignore_term", 2, stop_grace_period=1.0))
        exited = asyncio.Event()
        agent.add_listener(lambda e: e.kind is EventKind.WORKER_EXITED and exited.set())
        async with running(agent) as task:
            hellos = await hub.gather(2)
            hub.tell(hellos[0]["pid"], "exit 1")
            await asyncio.wait_for(exited.wait(), 30)  # the stop of the other one begins
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
    assert all(reaped(h["pid"]) for h in hellos)
