"""Worker processes: awaited exits, process-group stops, the grace period."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from aelastic.agent.processes import process
from aelastic.agent.processes.process import WorkerProcess, stop_processes

from .helpers import not_running, reaped

pytestmark = pytest.mark.anyio

READY = "import os, signal, sys, time\n"


def start(code: str) -> tuple[WorkerProcess, int]:
    """Start ``code``; it writes one line to the returned pipe when ready."""
    read_fd, write_fd = os.pipe()
    env = {**os.environ, "READY_FD": str(write_fd)}
    proc = WorkerProcess.start([sys.executable, "-c", READY + code], env, 0, pass_fds=[write_fd])
    os.close(write_fd)
    return proc, read_fd


async def ready(read_fd: int) -> str:
    line = await asyncio.wait_for(asyncio.to_thread(os.read, read_fd, 1024), 30)
    os.close(read_fd)
    return line.decode()


SIGNAL_READY = "os.write(int(os.environ['READY_FD']), b'%s\\n')\n"


async def test_exit_is_awaited_and_reaped() -> None:
    proc, fd = start("os.write(int(os.environ['READY_FD']), b'x'); sys.exit(5)")
    assert await ready(fd) == "x"
    assert await asyncio.wait_for(proc.wait(), 30) == 5
    assert proc.returncode == 5 and proc.exited_at is not None
    assert reaped(proc.pid)
    proc.close()


async def test_sigterm_ignored_then_killed_after_grace() -> None:
    code = (
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" + SIGNAL_READY % "ok" + "time.sleep(600)"
    )
    proc, fd = start(code)
    await ready(fd)
    started = time.monotonic()
    await stop_processes([proc], grace=0.3)
    assert time.monotonic() - started >= 0.3
    assert proc.returncode == -signal.SIGKILL
    assert reaped(proc.pid)


async def test_sigterm_stops_at_once_and_sweeps_the_group() -> None:
    code = (
        "import subprocess\n"
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "os.write(int(os.environ['READY_FD']), str(c.pid).encode())\n"
        "time.sleep(600)"
    )
    proc, fd = start(code)
    grandchild = int(await ready(fd))
    started = time.monotonic()
    await stop_processes([proc], grace=30)
    assert time.monotonic() - started < 20
    assert proc.returncode == -signal.SIGTERM
    assert reaped(proc.pid)
    assert not_running(grandchild)


async def test_stopping_exited_workers_is_harmless() -> None:
    proc, fd = start("os.write(int(os.environ['READY_FD']), b'x')")
    await ready(fd)
    await proc.wait()
    await stop_processes([proc], grace=1)
    assert proc.returncode == 0


async def test_waiter_thread_without_pidfd(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_pidfd(pid: int) -> int:
        raise OSError("pidfd_open unsupported")

    monkeypatch.setattr(os, "pidfd_open", no_pidfd)
    proc, fd = start("os.write(int(os.environ['READY_FD']), b'x'); sys.exit(3)")
    await ready(fd)
    assert await asyncio.wait_for(proc.wait(), 30) == 3
    assert reaped(proc.pid)


async def test_workers_are_armed_with_sigkill_on_the_agents_death() -> None:
    # PR_GET_PDEATHSIG (2): the signal the kernel sends this process when its parent dies.
    code = (
        "import ctypes\n"
        "sig = ctypes.c_int()\n"
        "ctypes.CDLL(None).prctl(2, ctypes.byref(sig), 0, 0, 0)\n"
        "os.write(int(os.environ['READY_FD']), str(sig.value).encode())\n"
    )
    proc, fd = start(code)
    assert int(await ready(fd)) == signal.SIGKILL
    await stop_processes([proc], grace=30)


# A worker that traps SIGTERM (PyTorch Lightning's handler) and counts the signals it got.
TRAPS_SIGTERM = (
    "got = []\n"
    "signal.signal(signal.SIGTERM, lambda *a: got.append(1))\n"
    + SIGNAL_READY % "ok"
    + "time.sleep(600)"
)


async def test_a_failing_worker_gets_no_sigterm_and_is_killed_once_its_python_is_done() -> None:
    proc, fd = start(TRAPS_SIGTERM)
    await ready(fd)
    python_done = asyncio.Event()
    started = time.monotonic()
    stop = asyncio.ensure_future(
        stop_processes([proc], grace=30, failing={proc.pid}, python_done={proc.pid: python_done})
    )
    await asyncio.sleep(0.3)
    assert not stop.done() and proc.returncode is None  # no SIGTERM: it ends by itself
    python_done.set()  # its last exit handler ran: only the interpreter's teardown is left
    await asyncio.wait_for(stop, 20)
    assert proc.returncode == -signal.SIGKILL
    assert time.monotonic() - started < 20
    assert reaped(proc.pid)


async def test_a_failing_worker_that_never_says_its_python_is_done_gets_the_grace() -> None:
    proc, fd = start(TRAPS_SIGTERM)
    await ready(fd)
    started = time.monotonic()
    await stop_processes([proc], grace=0.5, failing={proc.pid}, python_done={})
    assert time.monotonic() - started >= 0.5
    assert proc.returncode == -signal.SIGKILL


async def test_a_worker_that_traps_sigterm_keeps_the_whole_grace_in_a_real_stop() -> None:
    """torch's stop for everyone else: SIGTERM, the grace (the handler's time), SIGKILL;
    the event of a worker that did not say it is failing changes nothing until it is set."""
    proc, fd = start(TRAPS_SIGTERM)
    await ready(fd)
    started = time.monotonic()
    await stop_processes([proc], grace=0.5, python_done={proc.pid: asyncio.Event()})
    assert time.monotonic() - started >= 0.5
    assert proc.returncode == -signal.SIGKILL


def test_a_child_whose_agent_died_before_it_was_armed_exits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # As if the agent died between the fork and the arming: the parent is another process.
    monkeypatch.setattr(os, "getpid", lambda: 1)
    arm = process.child_setup(None)
    monkeypatch.undo()
    assert arm is not None
    child = subprocess.run(
        [sys.executable, "-c", "print('ran')"], preexec_fn=arm, capture_output=True, timeout=60
    )
    assert (child.returncode, child.stdout) == (1, b"")
