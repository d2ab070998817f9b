"""Worker processes: start each in its own session, await its exit, stop its process group.

How it works: a worker is a ``subprocess.Popen`` started with ``start_new_session=True``,
so its process group (id = its pid) holds it and whatever it forks. Its exit is awaited,
not polled: a pidfd registered with the event loop becomes readable when the process
exits (a waiter thread blocked in ``waitpid`` where pidfds are missing), and the exit is
reaped at once. :func:`stop_processes` sends SIGTERM to every group, waits up to the grace
period, SIGKILLs what is left, reaps every worker and sweeps the groups with SIGKILL so no
descendant outlives the stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import IO, Any

__all__ = ["WorkerProcess", "stop_processes"]

_Stream = int | IO[Any] | None


class WorkerProcess:
    """A started worker: its pid, its exit (awaitable) and its process group."""

    def __init__(self, popen: subprocess.Popen[bytes], local_rank: int) -> None:
        self._popen = popen
        self.local_rank = local_rank
        self.pid = popen.pid
        self.started_at = time.monotonic()
        #: Wall-clock time the exit was seen (``None`` while running).
        self.exited_at: float | None = None
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._exit: asyncio.Future[int] = loop.create_future()
        self._pidfd: int | None = None
        self._watch()

    @classmethod
    def start(
        cls,
        argv: Sequence[str],
        env: Mapping[str, str],
        local_rank: int,
        *,
        stdout: _Stream = None,
        stderr: _Stream = None,
        cwd: str | None = None,
        pass_fds: Sequence[int] = (),
    ) -> WorkerProcess:
        """Start ``argv`` in a new session (call on the event loop that will await it).

        Raises:
            OSError: The command could not be started (not found, not executable, ...).
        """
        popen = subprocess.Popen(
            list(argv),
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            cwd=cwd,
            pass_fds=tuple(pass_fds),
            start_new_session=True,
            close_fds=True,
        )
        return cls(popen, local_rank)

    def restarted(self) -> None:
        """Note that the process starts its real work now (a warm standby released)."""
        self.started_at = time.monotonic()

    def __repr__(self) -> str:
        return f"WorkerProcess(local_rank={self.local_rank}, pid={self.pid}, rc={self.returncode})"

    # -- exit -----------------------------------------------------------------------------

    def _watch(self) -> None:
        try:
            self._pidfd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):
            threading.Thread(
                target=self._wait_in_thread, name=f"aelastic-wait-{self.pid}", daemon=True
            ).start()
            return
        self._loop.add_reader(self._pidfd, self._on_pidfd)

    def _on_pidfd(self) -> None:
        self._release_pidfd()
        self._reap()

    def _release_pidfd(self) -> None:
        fd, self._pidfd = self._pidfd, None
        if fd is not None:
            self._loop.remove_reader(fd)
            os.close(fd)

    def _reap(self) -> None:
        code = self._popen.poll()
        if code is None:  # woken without an exit (should not happen): block briefly
            code = self._popen.wait()
        self._set_exit(code)

    def _wait_in_thread(self) -> None:
        code = self._popen.wait()
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting
            self._loop.call_soon_threadsafe(self._set_exit, code)

    def _set_exit(self, code: int) -> None:
        if not self._exit.done():
            self.exited_at = time.time()
            self._exit.set_result(code)

    @property
    def returncode(self) -> int | None:
        """The exit code once the exit was seen (negative: killed by that signal)."""
        return self._exit.result() if self._exit.done() else None

    async def wait(self) -> int:
        """Wait for the exit; the exit code (negative: the signal that killed it)."""
        return await asyncio.shield(self._exit)

    def alive_in_group(self) -> bool:
        """Whether any process is left in the worker's process group."""
        try:
            os.killpg(self.pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    # -- signals --------------------------------------------------------------------------

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the worker's process group (nothing if it is gone)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    def close(self) -> None:
        """Forget the exit watch (only for a process already reaped or abandoned)."""
        self._release_pidfd()


async def stop_processes(processes: Iterable[WorkerProcess], grace: float) -> None:
    """Stop ``processes``: SIGTERM their groups, wait ``grace`` s, SIGKILL, reap all.

    Safe to call on processes that already exited. Returns once every worker is reaped and
    whatever else was left in the workers' groups got SIGKILL and died.
    """
    procs = list(processes)
    running = [p for p in procs if p.returncode is None]
    for proc in procs:
        # Also the groups of workers that exited: their children may still run.
        proc.signal_group(signal.SIGTERM)
    if running:
        await asyncio.wait([asyncio.ensure_future(p.wait()) for p in running], timeout=grace)
    for proc in procs:
        proc.signal_group(signal.SIGKILL)
    left = [p for p in running if p.returncode is None]
    if left:
        await asyncio.wait([asyncio.ensure_future(p.wait()) for p in left])
    for proc in procs:
        proc.close()
    stragglers = [pid for p in procs if p.alive_in_group() for pid in _group_members(p.pid)]
    if stragglers:
        await _await_deaths(stragglers, _STRAGGLER_TIMEOUT)


#: Longest wait for SIGKILLed descendants to die (they are not ours to reap).
_STRAGGLER_TIMEOUT = 5.0


def _group_members(pgid: int) -> list[int]:
    """Live processes of process group ``pgid`` (Linux ``/proc``; empty elsewhere)."""
    members = []
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
                members.append(int(entry.name))
    return members


async def _await_deaths(pids: list[int], timeout: float) -> None:
    """Wait (at most ``timeout``) until ``pids`` have died; pidfds, no polling."""
    loop = asyncio.get_running_loop()
    waits: dict[int, asyncio.Future[None]] = {}
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            continue
        future: asyncio.Future[None] = loop.create_future()
        loop.add_reader(fd, _resolve, future)
        waits[fd] = future
    try:
        if waits:
            await asyncio.wait(waits.values(), timeout=timeout)
    finally:
        for fd in waits:
            loop.remove_reader(fd)
            os.close(fd)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
