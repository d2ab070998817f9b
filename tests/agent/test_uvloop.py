"""The agent inside a uvloop event loop (a service on uvloop embedding it): real workers
start, one crashes, the group restarts and succeeds; no signal handler is installed."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import pytest

from aelastic.agent import ElasticAgent, WorkerState

from .helpers import WorkerHub, make_handler, reaped, running, worker_spec

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGCHLD)


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    uvloop = pytest.importorskip("uvloop")
    return "asyncio", {"loop_factory": uvloop.new_event_loop}


async def test_a_crash_restarts_the_group_on_uvloop(run_id: str, tmp_path: Path) -> None:
    assert type(asyncio.get_running_loop()).__module__.startswith("uvloop")
    before = {sig: signal.getsignal(sig) for sig in HANDLED}
    async with WorkerHub() as hub:
        spec = worker_spec(make_handler(run_id), hub, "report", 2, max_restarts=1)
        async with running(ElasticAgent(spec)) as task:
            first = await hub.gather(2)
            assert [h["restart"] for h in first] == [0, 0]
            hub.tell(first[0]["pid"], "exit 3")
            second = await hub.gather(2)
            assert [h["restart"] for h in second] == [1, 1]
            assert all(reaped(h["pid"]) for h in first)
            assert {sig: signal.getsignal(sig) for sig in HANDLED} == before
            for hello in second:
                hub.release(hello["pid"])
            result = await task
    assert result.state is WorkerState.SUCCEEDED and result.failures == {}
    assert all(reaped(h["pid"]) for h in second)
