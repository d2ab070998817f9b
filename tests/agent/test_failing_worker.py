"""A failing worker tells its agent at once, and its interpreter's teardown is not waited for.

Real parts: a child interpreter started as the agent starts a worker (the bootstrap first on
its path, its own session), the agent's Unix socket (:class:`InPlaceChannel`) and the
agent's stop. The child traps SIGTERM (as PyTorch Lightning's workers do), raises the error
gloo raises when a peer's process is gone, has an exit handler of its own, and an object
whose finalizer takes a minute (a teardown that slow stands for torch's, seconds on a busy
machine). The agent hears ``failing`` with the traceback as soon as the exception reaches
the top, then ``exiting`` once the exit handlers ran; its stop sends the worker no SIGTERM
(which could only cut those handlers short) and SIGKILLs it once its Python code is over.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest

from aelastic.agent.health.progress import with_bootstrap
from aelastic.agent.processes.inplace import InPlaceChannel
from aelastic.agent.processes.process import WorkerProcess, stop_processes
from aelastic.worker._inplace import ENV_SOCKET
from aelastic.worker._site import _aelastic_guard as runtime

from .helpers import reaped

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

ROOT = str(Path(__file__).resolve().parents[2])

WORKER = """
import atexit, os, signal, sys, time
here = os.path.dirname(os.path.abspath(__file__))
signal.signal(signal.SIGTERM, lambda *a: open(os.path.join(here, "sigterm"), "w").close())

class SlowTeardown:
    def __del__(self):
        time.sleep(60)

keep = SlowTeardown()

def user_exit_handler():
    time.sleep(0.5)
    open(os.path.join(here, "exit-handler-done"), "w").close()

atexit.register(user_exit_handler)
os.write(int(os.environ["READY_FD"]), b"x")
time.sleep(float(sys.argv[1]))
raise RuntimeError(
    "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:5513. This is "
    "typically caused by a remote worker crashing."
)
"""


def test_the_bootstrap_names_the_agents_socket_as_the_in_place_channel_does() -> None:
    assert runtime.ENV_WORKERS_SOCKET == ENV_SOCKET


async def _start(tmp_path: Path, channel: InPlaceChannel) -> tuple[WorkerProcess, int]:
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(WORKER))
    read_fd, write_fd = os.pipe()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=ROOT, READY_FD=str(write_fd), **channel.env())
    with_bootstrap(env)
    proc = WorkerProcess.start([sys.executable, str(script), "0.2"], env, 0, pass_fds=[write_fd])
    os.close(write_fd)
    return proc, read_fd


async def test_a_failing_worker_says_so_at_once_and_its_teardown_is_not_waited_for(
    tmp_path: Path,
) -> None:
    channel = InPlaceChannel()
    await channel.start()
    try:
        proc, read_fd = await _start(tmp_path, channel)
        assert await asyncio.to_thread(os.read, read_fd, 1) == b"x"
        os.close(read_fd)
        await asyncio.wait_for(channel.failing.wait(), 30)
        [(pid, ending)] = channel.ending([proc]).items()
        assert pid == proc.pid and ending.in_collective  # gloo's message: a peer is gone
        assert "Connection closed by peer" in ending.error
        assert channel.interrupted_at([proc]) == ending.at
        assert proc.returncode is None  # told before the process is gone
        started = time.monotonic()
        python_done = {proc.pid: channel.python_done(proc.pid)}
        await stop_processes([proc], grace=90, failing={proc.pid}, python_done=python_done)
        assert time.monotonic() - started < 30  # not the finalizer's minute, nor the grace
        assert python_done[proc.pid].is_set()
        assert proc.returncode == -signal.SIGKILL and reaped(proc.pid)
        assert (tmp_path / "exit-handler-done").exists()  # the user's exit handler ran
        assert not (tmp_path / "sigterm").exists()  # and was not interrupted by SIGTERM
        channel.forget()  # a new set of workers
        assert channel.ending([proc]) == {} and channel.interrupted_at([proc]) is None
    finally:
        await channel.aclose()


async def test_an_error_of_the_workers_own_is_told_too_but_not_as_a_broken_collective(
    tmp_path: Path,
) -> None:
    channel = InPlaceChannel()
    await channel.start()
    try:
        script = tmp_path / "own.py"
        script.write_text("raise ValueError('the shard is corrupt')\n")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env.update(PYTHONPATH=ROOT, **channel.env())
        with_bootstrap(env)
        proc = WorkerProcess.start([sys.executable, str(script)], env, 0)
        assert await asyncio.wait_for(proc.wait(), 60) == 1  # its exit is its own
        await asyncio.wait_for(channel.failing.wait(), 30)
        ending = channel.ending([proc])[proc.pid]
        assert not ending.in_collective and "ValueError: the shard is corrupt" in ending.error
        proc.close()
    finally:
        await channel.aclose()
