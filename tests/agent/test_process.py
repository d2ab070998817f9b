"""Worker processes: awaited exits, process-group stops, the grace period."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import pytest

from aelastic.agent.process import WorkerProcess, stop_processes

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
