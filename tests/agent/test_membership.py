"""Several agents in one group: departures, late arrivals, dead peers, finishing nodes."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from aelastic.agent import ElasticAgent, EventKind, WorkerState
from aelastic.rendezvous import BackendRetry, RendezvousClosedError

from .._http_server import HttpServer
from ..cli._proc import sigint_as
from .helpers import WorkerHub, make_handler, not_running, reaped, running, worker_spec

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parents[2]


async def until(
    hub: WorkerHub, count: int, accept: Callable[[dict[str, Any]], bool]
) -> list[dict[str, Any]]:
    """The next ``count`` reports that ``accept``; earlier ones (a smaller round) are released."""
    found: list[dict[str, Any]] = []
    while len(found) < count:
        hello = await hub.next()
        if accept(hello):
            found.append(hello)
    return sorted(found, key=lambda h: h["rank"])


async def test_survivor_rescales_when_a_peer_is_cancelled(run_id: str) -> None:
    async with WorkerHub() as hub:
        agents = [
            ElasticAgent(
                worker_spec(make_handler(run_id, 1, 2, last_call_timeout=1.0), hub, nproc=1)
            )
            for _ in range(2)
        ]
        async with running(agents[0]) as first, running(agents[1]) as second:
            pair = await until(hub, 2, lambda h: h["world_size"] == 2)
            group_of = {h["group_rank"]: h for h in pair}
            second.cancel()
            with pytest.raises(asyncio.CancelledError):
                await second
            survivor = await hub.next()
            assert survivor["world_size"] == 1 and survivor["rank"] == 0
            assert survivor["restart"] == 0  # a rescale spends no restart
            assert all(reaped(h["pid"]) for h in group_of.values())
            hub.release(survivor["pid"])
            result = await first
    assert result.state is WorkerState.SUCCEEDED
    assert agents[0].metrics.rescales == 1 and agents[0].metrics.restarts == 0


async def test_late_node_scales_the_group_up(run_id: str) -> None:
    async with WorkerHub() as hub:

        def agent() -> ElasticAgent:
            handler = make_handler(run_id, 2, 3, last_call_timeout=0.3)
            return ElasticAgent(worker_spec(handler, hub, nproc=1))

        early = [agent(), agent()]
        async with running(early[0]) as a, running(early[1]) as b:
            await until(hub, 2, lambda h: h["world_size"] == 2)
            late = agent()
            async with running(late) as c:
                trio = await until(hub, 3, lambda h: h["world_size"] == 3)
                assert [h["rank"] for h in trio] == [0, 1, 2]
                assert [h["restart"] for h in trio] == [0, 0, 0]
                for hello in trio:
                    hub.release(hello["pid"])
                results = [await a, await b, await c]
    assert all(r.state is WorkerState.SUCCEEDED for r in results)
    assert early[0].metrics.rescales == 1 and late.metrics.rescales == 0


async def test_a_finished_node_does_not_restart_the_others(run_id: str) -> None:
    async with WorkerHub() as hub:

        def agent(barrier: float) -> ElasticAgent:
            handler = make_handler(run_id, 2, 2)
            return ElasticAgent(worker_spec(handler, hub, nproc=1, exit_barrier_timeout=barrier))

        quick, slow = agent(0.3), agent(60.0)
        events: list[Any] = []
        slow.add_listener(events.append)
        async with running(quick) as a, running(slow) as b:
            pair = await hub.gather(2)
            by_pid = {h["pid"]: h for h in pair}
            # The quick node's worker finishes; its barrier times out and it leaves.
            hub.release(quick.get_worker_group().workers[0].id)
            assert (await a).state is WorkerState.SUCCEEDED
            # The slow node noticed the departure, ignored it, and kept its worker. (The
            # stream is subscribed before the first look: no event can fall in between.)
            stream = slow.events()
            try:
                while not any(e.kind is EventKind.MEMBERSHIP_CHANGED for e in events):
                    await asyncio.wait_for(stream.get(), 30)
            finally:
                await stream.aclose()
            assert hub.pending() == 0
            slow_pid = slow.get_worker_group().workers[0].id
            assert slow_pid in by_pid
            hub.release(slow_pid)
            result = await b
    assert result.state is WorkerState.SUCCEEDED
    changes = [e for e in events if e.kind is EventKind.MEMBERSHIP_CHANGED]
    assert changes and all(e.data["ignored"] for e in changes)
    assert slow.metrics.restarts == 0 and slow.metrics.rescales == 0
    barrier = next(e for e in events if e.kind is EventKind.EXIT_BARRIER)
    assert barrier.data["complete"] is True
    handler = slow.spec.rdzv_handler
    state = await handler.backend.snapshot()
    assert state is not None and state.status.closed  # the job is done: closed


async def test_a_node_failing_for_good_closes_the_run_for_all(run_id: str) -> None:
    async with WorkerHub() as hub:
        agents = [
            ElasticAgent(worker_spec(make_handler(run_id, 2, 2), hub, nproc=1)) for _ in range(2)
        ]
        async with running(agents[0]) as a, running(agents[1]) as b:
            pair = await hub.gather(2)
            failing = next(h for h in pair if h["group_rank"] == 0)
            hub.tell(failing["pid"], "exit 7")
            done, _ = await asyncio.wait({a, b}, timeout=60)
            assert len(done) == 2
    failed = [t for t in (a, b) if t.exception() is None]
    aborted = [t for t in (a, b) if t.exception() is not None]
    assert len(failed) == 1 and failed[0].result().failures[0].exitcode == 7
    assert len(aborted) == 1 and isinstance(aborted[0].exception(), RendezvousClosedError)
    assert all(reaped(h["pid"]) for h in pair)


async def test_survivor_rescales_within_the_heartbeat_window_when_a_peer_is_killed(
    run_id: str, tmp_path: Path
) -> None:
    interval, attempts = 0.4, 2  # a 0.8 s window: shorter ones prune starved live nodes
    window = interval * attempts
    conf = {
        "last_call_timeout": "1.0",
        "keep_alive_interval": str(interval),
        "keep_alive_max_attempt": str(attempts),
        "join_timeout": "30",
    }
    with HttpServer() as server:
        async with WorkerHub() as hub:
            env = {**os.environ, **hub.env, "PYTHONPATH": str(ROOT)}
            env["AELASTIC_TEST_LOG_DIR"] = str(tmp_path)
            args = [str(Path(__file__).with_name("peer.py")), "http", server.endpoint, run_id]
            args += [f"{k}={v}" for k, v in conf.items()]
            peer = subprocess.Popen([sys.executable, *args], env=env, cwd=ROOT)  # noqa: ASYNC220
            try:
                handler = make_handler(
                    run_id, 1, 2, backend="http", endpoint=server.endpoint, **conf
                )
                agent = ElasticAgent(worker_spec(handler, hub, nproc=1))
                noticed: list[float] = []
                agent.add_listener(
                    lambda e: (
                        e.kind is EventKind.MEMBERSHIP_CHANGED and noticed.append(time.monotonic())
                    )
                )
                async with running(agent) as task:
                    pair = await until(hub, 2, lambda h: h["world_size"] == 2)
                    mine = agent.get_worker_group().workers[0].id
                    orphan = next(h["pid"] for h in pair if h["pid"] != mine)
                    killed = time.monotonic()
                    peer.send_signal(signal.SIGKILL)  # the node dies: agent and worker
                    os.kill(orphan, signal.SIGKILL)
                    survivor = await until(hub, 1, lambda h: h["world_size"] == 1)
                    latency = time.monotonic() - killed
                    detected = noticed[0] - killed
                    print(
                        f"peer killed: noticed after {detected:.3f} s (heartbeat window "
                        f"{window} s), new worker up after {latency:.3f} s"
                    )
                    assert survivor[0]["restart"] == 0
                    # Within the window (plus generous slack for a shared 2-core machine);
                    # the new round of one node then waits last_call_timeout to complete.
                    assert detected < window + 2.0
                    hub.release(survivor[0]["pid"])
                    try:
                        result = await asyncio.wait_for(asyncio.shield(task), 60)
                    except asyncio.TimeoutError:
                        group = agent.get_worker_group()
                        raise AssertionError(
                            f"the agent did not end 60 s after its worker was released: group "
                            f"{group.state}, round {group.group_rank}/{group.group_world_size}, "
                            f"workers {[(w.id, w.global_rank) for w in group.workers]}"
                        ) from None
                assert result.state is WorkerState.SUCCEEDED
                await handler.aclose()
            finally:
                peer.kill()
                peer.wait()


async def test_failure_stays_the_root_cause_when_the_restart_cannot_rendezvous(
    run_id: str,
) -> None:
    async with WorkerHub() as hub:
        # The peer cannot rejoin in time: its worker ignores SIGTERM, its grace is long.
        failing = ElasticAgent(
            worker_spec(make_handler(run_id, 2, 2, join_timeout=1.0), hub, nproc=1, max_restarts=1)
        )
        stuck = ElasticAgent(
            worker_spec(
                make_handler(run_id, 2, 2), hub, "ignore_term", nproc=1, stop_grace_period=3.0
            )
        )
        async with running(failing) as a, running(stuck) as b:
            pair = await hub.gather(2)
            mine = failing.get_worker_group().workers[0].id
            hub.tell(mine, "exit 4")
            result = await a
            b.cancel()
    assert result.state is WorkerState.FAILED
    assert [f.exitcode for f in result.failures.values()] == [4]
    assert all(reaped(h["pid"]) for h in pair)


# SIGINT inherited ignored once made run_sync deaf to it (asyncio.run then installs no
# handler): the script ran on until killed.
@pytest.mark.parametrize("inherited", ["default", "ignored"])
async def test_ctrl_c_in_a_run_sync_script_stops_its_workers(run_id: str, inherited: str) -> None:
    async with WorkerHub() as hub:
        env = {**os.environ, **hub.env, "PYTHONPATH": str(ROOT)}
        args = [str(Path(__file__).with_name("peer.py")), "memory", "local", run_id]
        args.append("last_call_timeout=0.1")
        script = subprocess.Popen(  # noqa: ASYNC220
            [sys.executable, *args], env=env, cwd=ROOT, preexec_fn=sigint_as(inherited)
        )
        try:
            hello = await hub.next()
            script.send_signal(signal.SIGINT)
            code = await asyncio.wait_for(asyncio.to_thread(script.wait), 60)
        finally:
            script.kill()
            script.wait()
    assert code in (-signal.SIGINT, 1, 130)  # KeyboardInterrupt, after the cleanup
    assert not_running(hello["pid"])


async def test_workers_run_on_through_a_backend_outage(run_id: str, tmp_path: Path) -> None:
    conf = {"keep_alive_interval": 0.5, "keep_alive_max_attempt": 20, "read_timeout": 2}
    with HttpServer(persist=tmp_path / "runs.json") as server:
        handler = make_handler(run_id, backend="http", endpoint=server.endpoint, **conf)
        async with WorkerHub() as hub:
            agent = ElasticAgent(worker_spec(handler, hub, nproc=1))
            noticed = asyncio.Event()
            retries: list[BackendRetry] = []

            def on_retry(event: object) -> None:
                if isinstance(event, BackendRetry):
                    retries.append(event)
                    noticed.set()

            agent.add_listener(on_retry)
            async with running(agent) as task:
                hello = await hub.next()
                server.stop()  # the backend goes away while the worker runs
                await asyncio.wait_for(noticed.wait(), 30)  # the node keeps trying
                server.start()
                hub.release(hello["pid"])
                result = await task
            assert hub.pending() == 0  # never restarted
        await handler.aclose()
    assert retries[0].backend == "http" and retries[0].round == 0
    assert result.state is WorkerState.SUCCEEDED
    assert agent.metrics.restarts == 0 and agent.metrics.rescales == 0
