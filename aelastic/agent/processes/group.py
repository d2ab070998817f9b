"""The workers of one attempt: spawn them with their environment and logs, report, stop.

How it works: a :class:`WorkerSet` is made for every start of the group. It creates the attempt's
log directories, builds each worker's environment and command (a callable is written to a private
payload file for the spawned interpreter, or forked by the fork server under ``fork``:
:mod:`aelastic.agent.processes.callables`), starts the processes in their own sessions (bound to
their CPUs with ``numa_binding``, :mod:`aelastic.agent.processes.numa`), and hands the teed pipes to
the log copier. With ``TORCHELASTIC_ENABLE_FILE_TIMER=1`` it serves torch's worker watchdog for the
attempt (:mod:`aelastic.agent.processes.timer`), and with hang detection on (the default) the
workers' progress pages (:mod:`aelastic.agent.health.progress`). It turns exits into
:class:`~aelastic.agent.api.ProcessFailure` values or return values (a worker stopped for a stall is
described by its stall and stacks), and stops everything (process groups with SIGTERM or the signal
the agent was stopped by, the watchdog, then log pipes) when the attempt ends; a worker that
outlives SIGKILL past the bound raises
:class:`~aelastic.agent.processes.unkillable.WorkersUnkillable` once the rest is cleaned up.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import IO, TYPE_CHECKING, Any

from ...core.errors import reason
from ...core.race import uncancellable
from ..api import ProcessFailure, WorkerGroup
from ..health.errors import make_failure
from ..health.progress import ProgressPages
from ..health.stall import Stall
from ..output.logs import AttemptLogs, Target
from . import callables
from .env import substitute_args, worker_env
from .numa import Binding, worker_binding
from .process import WorkerProcess, stop_processes
from .standby import Standby
from .timer import FILE_VAR, FileTimerServer
from .unkillable import Unkillable, WorkersUnkillable, unkillable_bound

if TYPE_CHECKING:
    from .forks import ForkServer

__all__ = ["WorkerSet"]

log = logging.getLogger("aelastic.agent")

_Stream = int | IO[Any] | None


class WorkerSet:
    """The processes and logs of one attempt of a worker group.

    Args:
        group: The group, after rank assignment.
        attempt: The attempt number (names the log directory).
        run_dir: The agent's ``<log_dir>/<run_id>_<random>``, or ``None`` for no log files.
        scratch: A private directory for callable payloads and results (callables only).
        restart_count: Restarts spent so far.
        run_id: The rendezvous run id.
        forks: The fork server of a callable under the ``fork`` start method.
        extra_env: Variables of aelastic's own for every worker (in-place recovery's socket,
            the agent's beat page).
    """

    def __init__(
        self,
        group: WorkerGroup,
        attempt: int,
        run_dir: str | None,
        scratch: str | None,
        restart_count: int,
        run_id: str,
        forks: ForkServer | None = None,
        extra_env: Mapping[str, str] | None = None,
    ) -> None:
        self._group = group
        self._extra_env = dict(extra_env or {})
        self._forks = forks
        self._attempt = attempt
        self._scratch = scratch
        self._restart_count = restart_count
        self._run_id = run_id
        self._logs = AttemptLogs(group.spec, run_dir, attempt)
        self.processes: list[WorkerProcess] = []
        #: Standbys that could not serve (closed; stop them).
        self.discarded: list[WorkerProcess] = []
        self._watchdog: FileTimerServer | None = None
        #: The workers' progress pages (``None``: no stall detection).
        self.progress: ProgressPages | None = None
        #: Workers stopped because they stalled, by local rank.
        self.stalls: dict[int, Stall] = {}
        self._abandoned: set[int] = set()

    async def start(
        self,
        before_spawn: Callable[[], None] = lambda: None,
        standbys: Mapping[int, Standby] | None = None,
    ) -> None:
        """Start every worker; ``before_spawn`` runs just before each spawn.

        A usable warm standby of the local rank becomes the worker; one that is not (or
        fails) is closed and left in :attr:`discarded` for the caller to stop. On any error
        the workers already started are stopped before it propagates.

        Raises:
            OSError: A command could not be started, or the watchdog's pipe not made.
            NumaBindingError: ``numa_binding`` cannot be applied.
            pickle.PicklingError: A callable entrypoint or its arguments cannot be pickled.
        """
        try:
            if FileTimerServer.enabled():
                self._watchdog = FileTimerServer(self._owns)
                self._watchdog.start()
            if self._group.spec.hang_rule() is not None:
                try:
                    self.progress = ProgressPages(self._group.spec.local_world_size)
                except OSError as exc:  # the run goes on, unwatched
                    log.warning("no hang detection for this attempt: %s", exc)
            for worker in self._group.workers:
                rank = worker.local_rank
                env = worker_env(
                    self._group,
                    worker,
                    restart_count=self._restart_count,
                    run_id=self._run_id,
                    error_file=self._logs.error_file(rank),
                )
                env.update(self._extra_env)
                if self._watchdog is not None:
                    env[FILE_VAR] = self._watchdog.path
                if self.progress is not None:
                    env.update(self.progress.env(rank))
                binding = worker_binding(
                    self._group.spec.numa_binding, self._group.spec.local_world_size, rank
                )
                stdout, stderr = self._logs.child_streams(rank)
                before_spawn()
                try:
                    proc = self._warm(standbys, rank, env, (stdout, stderr))
                    if proc is None and self._forks is not None:
                        proc = self._fork(rank, env, (stdout, stderr), binding)
                    if proc is None:
                        argv, fds = self._argv(rank)
                        proc = WorkerProcess.start(
                            argv if binding is None else binding.command(argv),
                            env,
                            rank,
                            stdout=stdout,
                            stderr=stderr,
                            pass_fds=fds,
                            affinity=None if binding is None else binding.affinity,
                        )
                except BaseException:
                    self._logs.abandon(rank)
                    raise
                self.processes.append(proc)
                worker.id = proc.pid
                await self._logs.after_spawn(rank, worker.global_rank)
        except BaseException:
            await uncancellable(self.stop(0.0))
            raise

    def _warm(
        self,
        standbys: Mapping[int, Standby] | None,
        local_rank: int,
        env: Mapping[str, str],
        streams: tuple[_Stream, _Stream],
    ) -> WorkerProcess | None:
        standby = None if standbys is None else standbys.get(local_rank)
        if standby is None:
            return None
        if standby.usable_for(env):
            args = substitute_args(self._group.spec.args, local_rank)[standby.launch.consumed :]
            fds = [None if s is None else s if isinstance(s, int) else s.fileno() for s in streams]
            try:
                return standby.release(env, args, fds)
            except OSError as exc:
                log.info(
                    "warm standby of local rank %d unusable (%s): cold start",
                    local_rank,
                    reason(exc),
                )
        standby.close()
        self.discarded.append(standby.process)
        return None

    def _fork(
        self,
        local_rank: int,
        env: Mapping[str, str],
        streams: tuple[_Stream, _Stream],
        binding: Binding | None,
    ) -> WorkerProcess:
        assert self._forks is not None
        fds = [None if s is None else s if isinstance(s, int) else s.fileno() for s in streams]
        return self._forks.spawn(
            local_rank,
            env,
            self._scratch_path(local_rank) + ".out",
            fds,
            affinity=None if binding is None else binding.cpus,
        )

    def _owns(self, pid: int) -> bool:
        """Whether ``pid`` runs in the process group of one of this attempt's workers."""
        try:
            group = os.getpgid(pid)
        except OSError:
            return False
        return any(p.pid == group for p in self.processes)

    def _argv(self, local_rank: int) -> tuple[list[str], list[int]]:
        """The worker's command, and the descriptors it must get (a callable's arguments)."""
        spec = self._group.spec
        args = substitute_args(spec.args, local_rank)
        if isinstance(spec.entrypoint, str):
            return [spec.entrypoint, *map(str, args)], []
        assert spec.entrypoint is not None
        base = self._scratch_path(local_rank)
        fds = callables.write_payload(base + ".in", spec.role, spec.entrypoint, args)
        return callables.child_argv(base + ".in", base + ".out"), fds

    def _scratch_path(self, local_rank: int) -> str:
        assert self._scratch is not None, "callable entrypoints need a scratch directory"
        return os.path.join(self._scratch, f"{self._attempt}_{local_rank}")

    def failures(self, failed: list[WorkerProcess]) -> dict[int, ProcessFailure]:
        """Describe ``failed`` workers, keyed by global rank."""
        result = {}
        for proc in failed:
            worker = self._group.workers[proc.local_rank]
            assert proc.returncode is not None
            logged = self._logs.targets(proc.local_rank)[1] in (Target.FILE, Target.TEE)
            result[worker.global_rank] = make_failure(
                local_rank=proc.local_rank,
                global_rank=worker.global_rank,
                pid=proc.pid,
                exitcode=proc.returncode,
                error_file=self._logs.error_file(proc.local_rank),
                role=self._group.spec.role,
                timestamp=proc.exited_at,
                stderr_log=self._logs.path(proc.local_rank, "stderr.log") if logged else None,
            )
            stall = self.stalls.get(proc.local_rank)
            if stall is not None:
                result[worker.global_rank] = _stalled(result[worker.global_rank], stall)
            scope = None if self._watchdog is None else self._watchdog.reaped.get(proc.pid)
            if scope is not None:
                failure = result[worker.global_rank]
                result[worker.global_rank] = dataclasses.replace(
                    failure,
                    message=f"{failure.message} (file-timer watchdog: timer '{scope}' expired)",
                )
        return result

    def return_values(self) -> dict[int, Any]:
        """What callable entrypoints returned, keyed by global rank (empty for commands)."""
        if isinstance(self._group.spec.entrypoint, str):
            return {}
        return {
            worker.global_rank: callables.read_result(
                self._scratch_path(worker.local_rank) + ".out"
            )
            for worker in self._group.workers
        }

    def abandon(self, survivors: Sequence[Unkillable]) -> None:
        """Give up on workers that outlived SIGKILL (reported): :meth:`stop` skips them."""
        self._abandoned.update(s.pid for s in survivors)

    def save_stacks(self, stall: Stall) -> str:
        """Write a stalled worker's stacks to its log directory; the file (``""``: none)."""
        if self._logs.dir is None or not stall.stacks:
            return ""
        path = self._logs.path(stall.local_rank, "stacks.txt")
        try:
            with open(path, "w", encoding="utf-8") as f:
                f.write(f"# {stall.describe()}\n{stall.stacks}")
        except OSError:
            return ""
        return path

    async def stop(
        self,
        grace: float,
        sig: int = signal.SIGTERM,
        *,
        failing: Collection[int] = (),
        python_done: Mapping[int, asyncio.Event] | None = None,
    ) -> None:
        """Stop and reap every worker (``sig``, ``grace`` s, SIGKILL), close the watchdog,
        then drain the logs. ``failing``, ``python_done``: workers ending by themselves
        (:func:`~aelastic.agent.processes.process.stop_processes`).

        Raises:
            WorkersUnkillable: Workers outlived SIGKILL past the bound (the rest is done).
        """
        procs, self.processes = self.processes + self.discarded, []
        self.discarded = []
        procs = [p for p in procs if p.pid not in self._abandoned]
        survivors: list[Unkillable] = []
        if procs:
            stop = stop_processes(procs, grace, sig, failing=failing, python_done=python_done)
            survivors = await stop
        if self._watchdog is not None:
            self._watchdog.close()
        if self.progress is not None:
            self.progress.close()
            self.progress = None
        await self._logs.aclose()
        if survivors:
            raise WorkersUnkillable(survivors, unkillable_bound(grace))


def _stalled(failure: ProcessFailure, stall: Stall) -> ProcessFailure:
    """``failure`` of a worker stopped for ``stall``: the stall is its message, its stacks
    its call stack."""
    message = stall.describe()
    extra = {"py_callstack": stall.stacks or message, "timestamp": str(int(time.time()))}
    return dataclasses.replace(
        failure,
        message=message,
        error_file_data={"message": {"message": message, "extraInfo": extra}},
        stalled=True,
        # Waiting for a peer: blamed after the peer. One that could not be asked for its
        # stacks (stopped, silent) is the suspect, before any rank that waits for it.
        secondary=stall.in_collective and not stall.unresponsive,
    )
