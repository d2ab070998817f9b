"""Worker processes: start each in its own session, await its exit, stop its process group.

How it works: a worker is a ``subprocess.Popen`` started with ``start_new_session=True``,
so its process group (id = its pid) holds it and whatever it forks. Its exit is awaited,
not polled: a pidfd registered with the event loop becomes readable when the process
exits (a waiter thread blocked in ``waitpid`` where pidfds are missing), and the exit is
reaped at once. :func:`stop_processes` sends SIGTERM to every group, waits up to the grace
period, SIGKILLs what is left, reaps every worker and sweeps the groups with SIGKILL so no
descendant outlives the stop. A worker already ending by itself (its uncaught exception
reached the top, and it said so: :mod:`aelastic.agent.processes.inplace`) gets no SIGTERM, which
could only cut its exit handlers short; once a failing worker's Python code is over (its
last exit handler said so) it is SIGKILLed instead of waited for through the interpreter's
teardown (seconds with torch loaded, on a busy machine).

No worker outlives its agent either, even one killed by SIGKILL. Two mechanisms:

* the kernel's parent-death signal. Between fork and exec the child asks for SIGKILL when
  its parent dies (``prctl(PR_SET_PDEATHSIG)``, through ctypes, in ``preexec_fn``: a ctypes
  call, ``os.getppid()`` and ``os._exit`` only), then exits at once if the agent died before
  that (``os.getppid()`` is no longer the agent). The kernel sends it when the *thread* that
  forked the child ends, not the process: workers are started on the agent's event-loop
  thread, which lives as long as the agent does (an embedding program must keep it so);
* the guardian (:mod:`aelastic.agent.processes._guard`), a small helper process in its own session,
  started before the first worker. Every worker's group is announced to it right after the spawn
  (one write) and withdrawn once stopped; when the agent process is gone it SIGKILLs each group
  still announced. The kernel's signal reaches only the worker; the guardian reaches the worker's
  children in its group too. An agent killed in the instant between a spawn and its announcement
  leaves that worker to the kernel's signal alone. The end of a run retires the guardian once no
  group is announced (:func:`retire_guardian`). Both kill at once, without the grace period of the
  agent's own stop: a node whose agent is gone is dropped by its peers, its workers have nothing
  left to do, and a worker that traps SIGTERM would hold its peers' collectives until the grace
  ended (:mod:`aelastic.agent.processes._guard`). A worker in uninterruptible sleep survives
  SIGKILL: the wait after it is bounded (:mod:`aelastic.agent.processes.unkillable`);
  :func:`stop_processes` names the survivors.

What neither reaches: processes a worker moved out of its group on purpose (``setsid``,
``setpgid``), as with any process-group based stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import IO, Any

from ._guard import group_members
from .orphans import GUARDIAN, child_setup
from .unkillable import Unkillable, inspect, keep, reap_kept, unkillable_bound

__all__ = ["WorkerProcess", "child_setup", "retire_guardian", "stop_processes"]

log = logging.getLogger("aelastic.agent")

_Stream = int | IO[Any] | None


class WorkerProcess:
    """A started worker: its pid, its exit (awaitable) and its process group."""

    def __init__(
        self, popen: subprocess.Popen[bytes] | None, local_rank: int, pid: int | None = None
    ) -> None:
        self._popen = popen
        self.local_rank = local_rank
        known = popen.pid if popen is not None else pid
        assert known is not None
        self.pid: int = known
        self.started_at = time.monotonic()
        #: Wall-clock time the exit was seen (``None`` while running).
        self.exited_at: float | None = None
        #: The same on the monotonic clock.
        self.exited_monotonic: float | None = None
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._exit: asyncio.Future[int] = loop.create_future()
        self._pidfd: int | None = None
        if popen is not None:
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
        affinity: frozenset[int] | None = None,
    ) -> WorkerProcess:
        """Start ``argv`` in a new session (call on the event loop that will await it).

        The process gets SIGKILL if this thread ends (the agent died), and its group is
        announced to the guardian, which SIGKILLs it if the agent process dies before
        :func:`stop_processes` did. ``affinity``: the CPUs
        the child binds itself to before ``exec`` (NUMA binding without ``numactl``).

        Raises:
            OSError: The command could not be started (not found, not executable, ...).
        """
        GUARDIAN.ensure()  # up before the spawn: the announcement follows it at once
        reap_kept()
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
            preexec_fn=child_setup(affinity),
        )
        GUARDIAN.watch(popen.pid)
        return cls(popen, local_rank)

    @staticmethod
    def before_spawn() -> None:
        """Call before another process starts a worker to be :meth:`adopted`."""
        GUARDIAN.ensure()

    @classmethod
    def adopted(cls, pid: int, local_rank: int) -> WorkerProcess:
        """A worker another process started in its own session and reaps (a fork server),
        announced to the guardian like :meth:`start`'s: whoever learns its exit status
        reports it with :meth:`exited` (call on the event loop that awaits it)."""
        GUARDIAN.watch(pid)
        return cls(None, local_rank, pid)

    def exited(self, code: int) -> None:
        """Report the exit status of an adopted worker (negative: killed by that signal)."""
        self._set_exit(code)

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
        assert self._popen is not None
        code = self._popen.poll()
        if code is None:  # woken without an exit (should not happen): block briefly
            code = self._popen.wait()
        self._set_exit(code)

    def _wait_in_thread(self) -> None:
        assert self._popen is not None
        code = self._popen.wait()
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting
            self._loop.call_soon_threadsafe(self._set_exit, code)

    def _set_exit(self, code: int) -> None:
        if not self._exit.done():
            self.exited_at = time.time()
            self.exited_monotonic = time.monotonic()
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

    def abandon(self) -> None:
        """Give up on the process (it outlived SIGKILL): reaped later if it ever dies (an
        adopted one by whoever started it)."""
        if self._popen is not None:
            keep(self._popen)


async def stop_processes(
    processes: Iterable[WorkerProcess],
    grace: float,
    sig: int = signal.SIGTERM,
    *,
    failing: Collection[int] = (),
    python_done: Mapping[int, asyncio.Event] | None = None,
) -> list[Unkillable]:
    """Stop ``processes``: ``sig`` (SIGTERM) to their groups, wait ``grace`` s, SIGKILL,
    reap all.

    ``failing``: pids of workers ending by themselves (an uncaught exception): they get no
    ``sig``. ``python_done``: by pid, an event set once a worker's Python code is over (its
    last exit handler ran): that worker is SIGKILLed then, not waited for through the
    interpreter's teardown.

    Safe to call on processes that already exited. Returns once every worker is reaped and
    whatever else was left in the workers' groups got SIGKILL and died, or once the bound
    after SIGKILL passed (:func:`~aelastic.agent.processes.unkillable.unkillable_bound`): then with
    the workers still alive, as ``/proc`` describes them (empty when all died).
    """
    procs = list(processes)
    python_done = python_done or {}
    running = [p for p in procs if p.returncode is None]
    for proc in procs:
        # Also the groups of workers that exited: their children may still run.
        if proc.returncode is not None or proc.pid not in failing:
            proc.signal_group(sig)
    if running:
        waits = [asyncio.ensure_future(_ended(p, python_done.get(p.pid))) for p in running]
        try:
            await asyncio.wait(waits, timeout=grace)
        finally:
            for wait in waits:
                wait.cancel()
    for proc in procs:
        proc.signal_group(signal.SIGKILL)
    left = [p for p in running if p.returncode is None]
    if left:
        bound = unkillable_bound(grace)
        await asyncio.wait([asyncio.ensure_future(p.wait()) for p in left], timeout=bound)
    survivors = [p for p in left if p.returncode is None]  # waited for enough
    for proc in procs:
        proc.close()
    gone = {p.pid for p in survivors}
    stragglers = [pid for p in procs if p.alive_in_group() for pid in group_members(p.pid)]
    stragglers = [pid for pid in stragglers if pid not in gone]
    if stragglers:
        await _await_deaths(stragglers, _STRAGGLER_TIMEOUT)
    for proc in procs:
        GUARDIAN.forget(proc.pid)
    for proc in survivors:
        proc.abandon()
    return [inspect(p.pid, p.local_rank) for p in survivors]


async def retire_guardian() -> None:
    """End the guardian when no worker group is announced (the end of a run): its exit is
    awaited and reaped, so no helper outlives the run (SIGKILL after
    :data:`_STRAGGLER_TIMEOUT`, should it not have exited at the pipe's end)."""
    pid = GUARDIAN.retire()
    if pid is None:
        return
    for sig in (None, signal.SIGKILL):  # it exits at the pipe's end; if not, it is killed
        if sig is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        await _await_deaths([pid], _STRAGGLER_TIMEOUT)
        if _reap_now(pid):
            return


def _reap_now(pid: int) -> bool:
    """Reap child ``pid`` if it exited (never waits); whether it is gone."""
    try:
        return os.waitpid(pid, os.WNOHANG)[0] != 0
    except ChildProcessError:
        return True


async def _ended(proc: WorkerProcess, python_done: asyncio.Event | None) -> None:
    """Until ``proc`` exited; SIGKILLed first once ``python_done`` is set (its Python code
    is over: only the interpreter's teardown is left)."""
    if python_done is not None:
        exited = asyncio.ensure_future(proc.wait())
        done = asyncio.ensure_future(python_done.wait())
        try:
            await asyncio.wait([exited, done], return_when=asyncio.FIRST_COMPLETED)
        finally:
            exited.cancel()
            done.cancel()
        if proc.returncode is None:
            proc.signal_group(signal.SIGKILL)
    await proc.wait()


#: Longest wait for SIGKILLed descendants to die (they are not ours to reap).
_STRAGGLER_TIMEOUT = 5.0


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
