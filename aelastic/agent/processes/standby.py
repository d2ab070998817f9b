"""Warm standbys: interpreters started ahead of time, so a restart skips Python's startup.

How it works: most of a restart's latency is the new workers' interpreter startup (about
0.1 s here, far more than the agent's own work). When the entrypoint is this interpreter
running a script or ``-m module`` (what ``torchrun`` and ``aelastic run`` launch), the
agent keeps one idle interpreter per local rank, started with the same executable, flags,
working directory and environment as the worker would get, minus the variables that change
per attempt. It blocks (no CPU) on a Unix socket. To start a worker the agent sends it the
full environment, the argv and the redirected stdout/stderr descriptors (SCM_RIGHTS); the
standby (``python [flags] .../aelastic/agent/_standby.py FD``, see
:mod:`aelastic.agent.processes._standby`) applies them, then runs the script in ``__main__`` as
``python script.py`` would (``sys.path[0]``, ``__file__``, ``sys.argv``), or the module as
``python -m`` does.

A standby is used only when that is indistinguishable for the worker: the environment
apart from the per-attempt variables is unchanged since it started, and it is alive.
Otherwise the worker is started cold. Standbys die with the agent (they exit when the
socket closes, and are started like workers: SIGKILL on the agent's death, watched by the
guardian) and are stopped with the workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from ...core.errors import reason
from ...core.race import cancel_and_wait, uncancellable
from ..api import WorkerSpec
from ..health.progress import with_bootstrap, without_bootstrap
from .env import ATTEMPT_KEYS, inherited_env
from .numa import Binding, NumaBindingError, worker_binding
from .process import WorkerProcess, stop_processes

__all__ = ["STANDBY_DELAY", "Launch", "Standby", "StandbyPool", "launch_of", "standby_env"]

log = logging.getLogger("aelastic.agent")

#: Interpreter options that may precede the script (flags without a value).
_FLAGS = frozenset({"-u", "-B", "-O", "-OO", "-s", "-E", "-q", "-b", "-bb", "-d", "-v"})

#: The standby's program, run as a script (see :mod:`aelastic.agent.processes._standby`).
_STANDBY_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_standby.py")


@dataclass(frozen=True)
class Launch:
    """How a worker command runs Python: ``exe [flags] (script | -m module) args``."""

    executable: str
    flags: tuple[str, ...]
    script: str | None
    module: str | None
    #: How many leading arguments the flags and the script or module take.
    consumed: int


def launch_of(spec: WorkerSpec) -> Launch | None:
    """The Python launch of ``spec``'s command, or ``None`` when a standby cannot run it."""
    entry = spec.entrypoint
    if not isinstance(entry, str) or not spec.warm_standby:
        return None
    if os.path.realpath(entry) != os.path.realpath(sys.executable):
        return None
    args = [str(a) for a in spec.args]
    flags = []
    while args and args[0] in _FLAGS:
        flags.append(args.pop(0))
    if not args or "${local_rank}" in args[0] or (args[0] == "-m" and len(args) < 2):
        return None
    if args[0] == "-m":
        if "${local_rank}" in args[1]:
            return None
        return Launch(entry, tuple(flags), None, args[1], len(flags) + 2)
    if args[0].startswith("-"):
        return None  # -c, -X, -W, ...: not worth the parsing
    return Launch(entry, tuple(flags), args[0], None, len(flags) + 1)


def standby_env(spec: WorkerSpec, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a standby starts with: the worker's without the per-attempt keys."""
    env = inherited_env(base)
    env.update(spec.env)
    with_bootstrap(env)
    return {k: v for k, v in env.items() if k not in ATTEMPT_KEYS}


class Standby:
    """An idle interpreter that becomes a worker on :meth:`release`.

    Args:
        launch: The worker's Python launch.
        base_env: The environment to start it with (the worker's, minus per-attempt keys).
        local_rank: The local rank it will serve.
        binding: The CPUs of the local rank's worker (``numa_binding``), applied at start.
        preload: Modules it imports before it waits (``WorkerSpec.standby_preload``).
    """

    def __init__(
        self,
        launch: Launch,
        base_env: Mapping[str, str],
        local_rank: int,
        binding: Binding | None = None,
        preload: tuple[str, ...] = (),
    ) -> None:
        self.launch = launch
        self.base_env = dict(base_env)
        self.local_rank = local_rank
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            argv = [launch.executable, *launch.flags, _STANDBY_SCRIPT, str(theirs.fileno())]
            if preload:
                argv.append(",".join(preload))
            self.process = WorkerProcess.start(
                argv if binding is None else binding.command(argv),
                self.base_env,
                local_rank,
                pass_fds=[theirs.fileno()],
                affinity=None if binding is None else binding.affinity,
            )
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        self._ctl = mine

    def usable_for(self, env: Mapping[str, str]) -> bool:
        """Whether a worker with ``env`` would see exactly what a cold start gives it."""
        if self.process.returncode is not None:
            return False
        keys = (set(env) | set(self.base_env)) - ATTEMPT_KEYS
        return all(env.get(k) == self.base_env.get(k) for k in keys)

    def release(
        self, env: Mapping[str, str], args: Sequence[str], streams: Sequence[int | None]
    ) -> WorkerProcess:
        """Make the standby run the worker; its process is then the worker's.

        Args:
            env: The worker's full environment.
            args: The worker's arguments after the script or module.
            streams: Descriptors for stdout and stderr (``None``: keep the agent's).

        Raises:
            OSError: The standby is gone.
        """
        dup = [target for target, fd in zip((1, 2), streams, strict=True) if fd is not None]
        fds = [fd for fd in streams if fd is not None]
        env = without_bootstrap(env)  # it ran at the standby's start, and took itself off
        job = {
            "env": dict(env),
            "unset": sorted(set(self.base_env) - set(env)),
            "dup": dup,
            "script": self.launch.script,
            "module": self.launch.module,
            "args": [str(a) for a in args],
        }
        try:
            socket.send_fds(self._ctl, [json.dumps(job).encode()], fds)
        finally:
            self._ctl.close()
        self.process.restarted()
        return self.process

    def close(self) -> None:
        """Close the control socket (an idle standby then exits by itself)."""
        with contextlib.suppress(OSError):
            self._ctl.close()


#: Seconds after an attempt's start before its warm standbys start (so that they do not
#: compete with the workers' own startup for CPU).
STANDBY_DELAY = 0.25
#: Seconds an idle standby gets to exit on SIGTERM.
_STANDBY_GRACE = 2.0


class StandbyPool:
    """The standbys of the next attempt: started after each start, taken at the next.

    Args:
        spec: The worker spec (no standbys unless :func:`launch_of` accepts it).
        on_ready: Called with ``{local_rank: pid}`` once the standbys are up.
    """

    def __init__(self, spec: WorkerSpec, on_ready: Callable[[dict[int, int]], None]) -> None:
        self._spec = spec
        self._launch = launch_of(spec)
        self._on_ready = on_ready
        self._ready: dict[int, Standby] = {}
        self._task: asyncio.Task[None] | None = None

    def schedule(self) -> None:
        """Start the next attempt's standbys in a moment (when the spec allows any)."""
        if self._launch is not None and self._task is None:
            self._task = asyncio.ensure_future(self._start(self._launch))

    async def _start(self, launch: Launch) -> None:
        await asyncio.sleep(STANDBY_DELAY)
        env = standby_env(self._spec)
        for rank in range(self._spec.local_world_size):
            try:
                binding = worker_binding(self._spec.numa_binding, self._spec.local_world_size, rank)
                preload = self._spec.standby_preload
                self._ready[rank] = Standby(launch, env, rank, binding, preload)
            except (OSError, NumaBindingError) as exc:
                log.warning("could not start a warm standby: %s", reason(exc))
                return
        self._on_ready({rank: s.process.pid for rank, s in self._ready.items()})

    async def take(self) -> dict[int, Standby]:
        """The standbys that are up (by local rank); the pool is empty afterwards."""
        task, self._task = self._task, None
        if task is not None:
            await cancel_and_wait(task)
        ready, self._ready = self._ready, {}
        return ready

    @staticmethod
    async def discard(standbys: Iterable[Standby]) -> None:
        """Stop standbys that will not serve (shielded from cancellation)."""
        unused = list(standbys)
        for standby in unused:
            standby.close()
        if unused:
            await uncancellable(stop_processes([s.process for s in unused], _STANDBY_GRACE))

    async def aclose(self) -> None:
        """Stop every standby."""
        await self.discard((await self.take()).values())
