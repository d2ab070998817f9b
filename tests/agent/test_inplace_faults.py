"""In-place recovery when it goes wrong (real workers, gloo on CPU, memory rendezvous).

* A worker that opted in says its collective broke, but no member of the round is lost:
  after the heartbeat window (and a beat and a second) its agent tells it to fail; it exits
  with its own error, which is the run's failure (with no restart left: FAILED).
* Workers kept through a group change that do not join their new group within
  ``recovery_timeout`` are stopped and started again the old way, spending no restart; the
  other node's worker, kept too, goes on in the same process.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import anyio
import pytest

from aelastic.agent import ElasticAgent, WorkerSpec, WorkerState
from aelastic.core.events import Event, EventKind

from .helpers import make_handler, running

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(150)]

FAULTY = str(Path(__file__).with_name("_inplace_fault.py"))
# A window of 0.8 s: shorter ones let a starved live node be pruned on a loaded machine, and
# the churn that follows (rounds re-formed; workers making their group then started again,
# tests/agent/test_inplace_channel.py) slows the test down.
BEAT = {"keep_alive_interval": 0.4, "keep_alive_max_attempt": 2}


def spec(handler: object, *args: str, **kwargs: object) -> WorkerSpec:
    return WorkerSpec(
        "trainer",
        1,
        handler,  # type: ignore[arg-type]
        sys.executable,
        (FAULTY, *args),
        max_restarts=0,
        stop_grace_period=5,
        standby_preload=("torch",),
        **kwargs,  # type: ignore[arg-type]
    )


async def test_a_broken_collective_with_no_peer_lost_fails_with_the_workers_own_error(
    run_id: str,
) -> None:
    pytest.importorskip("torch.distributed")
    handler = make_handler(run_id, **BEAT)
    grace = handler.settings.heartbeat_window + handler.settings.keep_alive_interval + 1.0
    agent = ElasticAgent(spec(handler, "broken-alone"))
    seen: list[tuple[float, Event]] = []
    agent.add_listener(lambda event: seen.append((time.monotonic(), event)))
    result = await agent.run()
    assert result.state is WorkerState.FAILED
    [failure] = result.failures.values()
    assert "Connection closed by peer" in failure.message
    started = next(t for t, e in seen if e.kind is EventKind.WORKERS_STARTED)
    exited = next(t for t, e in seen if e.kind is EventKind.WORKER_EXITED)
    assert exited - started >= grace - 0.1  # it waited for a peer's loss that never came
    assert agent.restart_count == 0


async def test_workers_that_do_not_join_in_time_restart_the_old_way_spending_none(
    run_id: str, tmp_path: Path
) -> None:
    pytest.importorskip("torch.distributed")
    marker = str(tmp_path / "stuck-once")
    conf = {**BEAT, "last_call_timeout": 1.0}
    survivor = ElasticAgent(
        spec(make_handler(run_id, 1, 2, **conf), "stuck-handover", marker, recovery_timeout=3)
    )
    leaving = ElasticAgent(spec(make_handler(run_id, 1, 2, **conf), "stuck-handover", marker))
    seen: list[Event] = []
    survivor.add_listener(seen.append)
    async with running(survivor) as one, running(leaving) as two:
        together = 0
        while together < 2:  # both workers in their group of two (and kept when it changes)
            together = len([p async for p in anyio.Path(tmp_path).glob("stuck-once.*")])
            await anyio.sleep(0.05)
        two.cancel()
        result = await one
    assert result.state is WorkerState.SUCCEEDED, result.failures
    assert await anyio.Path(marker).exists()  # the survivor hung in its hand-over
    kinds = [e.kind for e in seen]
    recovered = kinds.index(EventKind.WORKERS_RECOVERED)  # kept once, in place
    reasons = [getattr(e, "reason", "") for e in seen[recovered:]]
    assert "workers did not recover in place in time: restarting" in reasons, [
        (e.kind.value, getattr(e, "reason", ""), getattr(e, "pids", "")) for e in seen
    ]
    assert EventKind.WORKERS_STARTED in kinds[recovered:]  # then started the old way
    assert survivor.restart_count == 0
