"""The agent's beat and the workers that watch it, with real child interpreters (no torch).

A child started as the agent starts a worker (the bootstrap first on ``PYTHONPATH``, a
session of its own, the beat page in its environment) lives as long as the page's deadline
keeps moving; when the beat stops (the agent's loop frozen) it stops itself within the
deadline and a moment, with the process it started in its group, says why on stderr and in
its error file; a page closed by an agent that ends is never acted on. The deadline follows
the node's last keep-alive. The real frozen agent (SIGSTOP) is in tests/cli/test_frozen_agent.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest

from aelastic.agent.health.progress import with_bootstrap
from aelastic.agent.processes.beat import AgentBeat
from tests.cli._proc import alive

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

ROOT = str(Path(__file__).resolve().parents[2])

# Starts a child in its process group, says both pids, then sleeps.
WORKER = """
import os, subprocess, sys, time
child = subprocess.Popen(["sleep", "600"])
print(os.getpid(), child.pid, flush=True)
time.sleep(600)
"""


@dataclass
class _Settings:
    heartbeat_window: float
    keep_alive_interval: float


class _Handler:
    """What the beat reads of a rendezvous handler."""

    def __init__(self, window: float, interval: float, age: float | None = None) -> None:
        self.settings = _Settings(window, interval)
        self.keep_alive_age = age


def _beat(window: float = 1.0, interval: float = 0.5, age: float | None = None) -> AgentBeat:
    handler: Any = _Handler(window, interval, age)
    return AgentBeat(handler)


@asynccontextmanager
async def _worker(
    tmp_path: Path, beat: AgentBeat
) -> AsyncIterator[tuple[subprocess.Popen[str], int]]:
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(WORKER))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=ROOT, TORCHELASTIC_ERROR_FILE=str(tmp_path / "error.json"))
    env.update(beat.env())
    with_bootstrap(env)
    proc = subprocess.Popen(  # noqa: ASYNC220 - a fork and exec: no wait
        [sys.executable, str(script)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # as the agent starts a worker
    )
    try:
        assert proc.stdout is not None
        line = await anyio.to_thread.run_sync(proc.stdout.readline)  # the loop beats on
        pid, child = map(int, line.split())
        assert pid == proc.pid
        yield proc, child
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
        proc.communicate(timeout=30)


async def _gone(pid: int, within: float) -> float:
    started = time.monotonic()
    while alive(pid):
        assert time.monotonic() - started < within, f"pid {pid} still runs"
        await anyio.sleep(0.02)
    return time.monotonic() - started


async def test_a_worker_whose_agent_stops_beating_stops_itself_and_its_group(
    tmp_path: Path,
) -> None:
    beat = _beat()
    beat.start()
    try:
        async with _worker(tmp_path, beat) as (proc, child):
            await anyio.sleep(3 * beat.slack)  # the beat keeps it alive
            assert proc.poll() is None and alive(child)
            frozen = time.monotonic()
            assert beat._task is not None
            beat._task.cancel()  # the agent's loop stops running
            took = await _gone(proc.pid, beat.slack + 10)
            await _gone(child, 5)
            assert proc.wait(5) == -9
            assert took <= beat.slack + 5  # the deadline, and a loaded machine's moment
            assert time.monotonic() - frozen >= beat.slack - beat.period - 0.05
            _, err = proc.communicate(timeout=10)
        assert "this worker's agent (pid" in err and "has not run for" in err, err
        assert "heartbeat window 1 s" in err and f"(pid {proc.pid}) stops" in err
        doc = json.loads((tmp_path / "error.json").read_text())
        assert "this worker's agent" in doc["message"]["message"]
        assert beat.lapsed(since=frozen)  # the agent, running again, learns it
    finally:
        await beat.aclose()


async def test_a_worker_of_an_agent_that_ends_is_left_to_the_agent(tmp_path: Path) -> None:
    # A window of seconds: with 0.6 s, a loaded machine left this test's own loop (the
    # agent's beat) unscheduled past its slack, and the beat had lapsed.
    beat = _beat(window=3.0, interval=1.0)
    beat.start()
    async with _worker(tmp_path, beat) as (proc, child):
        await anyio.sleep(2 * beat.slack)
        assert not beat.lapsed(since=0.0)
        await beat.aclose()  # the agent ends: it stops its workers itself
        assert beat.env() == {}
        await anyio.sleep(4 * beat.slack)
        assert proc.poll() is None and alive(child)


async def test_no_page_no_watch(tmp_path: Path) -> None:
    beat = _beat()  # never started: the workers get no variable, and live on
    assert beat.env() == {}
    async with _worker(tmp_path, beat) as (proc, _):
        await anyio.sleep(0.5)
        assert proc.poll() is None
    await beat.aclose()


def test_the_deadline_is_a_window_after_the_last_keep_alive_never_less_than_the_slack() -> None:
    assert _beat(15.0, 5.0).slack == 10.0 and _beat(15.0, 5.0).period == 1.0
    assert _beat(0.9, 0.3).slack == pytest.approx(0.6)
    assert _beat(5.0, 5.0).slack == 1.0  # one attempt: half the window, 1 s at most
    assert _beat(15.0, 5.0, age=None).deadline(100.0) == 110.0  # no round: the slack
    assert _beat(15.0, 5.0, age=2.0).deadline(100.0) == 113.0  # sent at 98: dropped at 113
    assert _beat(15.0, 5.0, age=9.0).deadline(100.0) == 110.0  # held by a slow backend
