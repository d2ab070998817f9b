"""The agent's end of in-place recovery: a local socket to the workers that opted in.

How it works: the agent listens on a Unix socket in a private directory (mode 0700) and
gives its path to every worker (``AELASTIC_INPLACE_SOCKET``). A worker that uses
:class:`aelastic.worker.InPlace` connects and says ``hello`` (its pid); scripts that do not
never connect, and the agent treats them exactly as before. When the group changes and every
local worker of the attempt is alive, said hello and made its current group, the agent keeps them
(:meth:`InPlaceChannel.hold`: each is told ``changing``), re-rendezvouses, and sends each its
new ranks and master (:meth:`resume`, one JSON line); each answers ``joined`` once its new
process group is made and the state handed over. A worker whose collective broke says
``broken`` and waits: the agent waits for the group change that explains it, or tells it
``fail`` (its own error is raised again and it exits as it would have). Messages are JSON
lines; the socket is read on the agent's loop (no thread).

Every worker uses the socket once more, opted in or not, when it fails: the bootstrap's
exception hook (``aelastic.worker._site``) says ``failing`` with the traceback's end as
soon as an uncaught exception reaches the top, and ``exiting`` from its last exit handler,
once its Python code is over. The first is the earliest sign of a collective broken by a
peer's loss (the agent asks the rendezvous at once whether a member is gone, seconds
before the process has torn its interpreter down); the second lets the agent's stop end
the worker without waiting for that teardown (:class:`Ending`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ...core.race import Signal, wait_within
from ...worker._inplace import ENV_SOCKET, ROUND_KEYS
from ..health.errors import raised_in_collective
from .process import WorkerProcess

__all__ = ["ENV_SOCKET", "Ending", "InPlaceChannel"]

log = logging.getLogger("aelastic.agent")

#: Longest line a worker may send (bytes).
_LINE_LIMIT = 1 << 16
#: Longest path a Unix socket may have (``sun_path`` holds 108 bytes with its NUL).
_SOCKET_PATH_MAX = 107


def _socket_dir() -> str:
    """A new private directory for the socket: in the temporary directory, or in /tmp when
    that one's path is too long for a socket (a long ``TMPDIR``, as a scheduler may set)."""
    made = tempfile.mkdtemp(prefix="aelastic-inplace-")
    if len(os.fsencode(os.path.join(made, "s"))) <= _SOCKET_PATH_MAX:
        return made
    os.rmdir(made)
    return tempfile.mkdtemp(prefix="aelastic-inplace-", dir="/tmp")


class _Worker:
    """One connected worker."""

    __slots__ = ("broken", "joined", "writer")

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.joined = -1
        self.broken: str | None = None


class Ending:
    """A worker that said it is failing (an uncaught exception reached the top).

    Args:
        error: The end of its traceback.
    """

    __slots__ = ("at", "error")

    def __init__(self, error: str) -> None:
        #: When the agent heard it (monotonic).
        self.at = time.monotonic()
        self.error = error

    @property
    def in_collective(self) -> bool:
        """Whether it broke inside a collective (a peer's loss, most likely)."""
        return raised_in_collective(self.error)


class InPlaceChannel:
    """The socket the workers of one agent talk to (see the module docstring)."""

    def __init__(self) -> None:
        self._dir: str | None = None
        self._server: asyncio.AbstractServer | None = None
        self._workers: dict[int, _Worker] = {}
        #: Set when a worker says its collective broke (see :attr:`broken_since`).
        self.broken = Signal()
        #: Set when a worker says it joined its new group.
        self.joined = Signal()
        #: The generation of the workers' group: 0 at their start, +1 per change in place.
        self.gen = 0
        #: Workers that waited for a group change were told to fail (their failures are
        #: their own: no more waiting for a peer's loss).
        self.told_fail = False
        #: Set when a worker says it is failing (see :meth:`ending`).
        self.failing = Signal()
        self._ending: dict[int, Ending] = {}
        self._python_done: dict[int, asyncio.Event] = {}
        self._broken_at: float | None = None  # when a worker first said its collective broke

    async def start(self) -> None:
        """Listen (once); a failure leaves in-place recovery off for this agent."""
        if self._server is not None:
            return
        try:
            self._dir = _socket_dir()
            self._server = await asyncio.start_unix_server(
                self._accept, os.path.join(self._dir, "s"), limit=_LINE_LIMIT
            )
        except OSError as exc:
            log.warning("no in-place recovery for this agent: %s", exc)
            await self.aclose()

    def env(self) -> dict[str, str]:
        """The variable that tells a worker where to connect (empty when off)."""
        return {} if self._dir is None else {ENV_SOCKET: os.path.join(self._dir, "s")}

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        pid: int | None = None
        try:
            while line := await reader.readline():
                message = json.loads(line)
                pid = int(message.get("pid", 0)) or pid
                if pid is None:
                    continue
                op = message.get("op")
                if op in ("failing", "exiting"):
                    self._failing(pid, op, message)
                elif op == "hello":
                    self._workers[pid] = _Worker(writer)
                elif (worker := self._workers.get(pid)) is None:
                    continue
                elif op == "broken" and int(message.get("gen", self.gen)) >= self.gen:
                    worker.broken = str(message.get("error", ""))  # else: a round came since
                    self._broken_at = self._broken_at or time.monotonic()
                    self.broken.set()
                elif op == "joined":
                    worker.joined = int(message.get("gen", 0))
                    worker.broken = None
                    self.joined.set()
        except (OSError, ValueError) as exc:
            log.debug("in-place channel of pid %s: %s", pid, exc)
        finally:
            if pid is not None and (w := self._workers.get(pid)) is not None and w.writer is writer:
                del self._workers[pid]
            writer.close()

    def _failing(self, pid: int, op: str, message: Mapping[str, Any]) -> None:
        if op == "failing" and pid not in self._ending:
            self._ending[pid] = Ending(str(message.get("error", "")))
            self.failing.set()
        elif op == "exiting" and pid in self._ending:
            self.python_done(pid).set()

    # -- what the agent asks --------------------------------------------------------------

    def ending(self, processes: Iterable[WorkerProcess]) -> dict[int, Ending]:
        """The workers of ``processes`` that said they are failing, by pid."""
        return {p.pid: e for p in processes if (e := self._ending.get(p.pid)) is not None}

    def python_done(self, pid: int) -> asyncio.Event:
        """An event set once the failing worker ``pid`` says its Python code is over."""
        return self._python_done.setdefault(pid, asyncio.Event())

    def interrupted_at(self, processes: Iterable[WorkerProcess]) -> float | None:
        """When a worker of ``processes`` first gave a sign of trouble on this channel (it
        said it is failing, or that its collective broke): monotonic, or ``None``."""
        times = [e.at for e in self.ending(processes).values()]
        if self._broken_at is not None:
            times.append(self._broken_at)
        return min(times, default=None)

    def opted_in(self, processes: Sequence[WorkerProcess]) -> bool:
        """Whether every worker of ``processes`` is alive and recovers in place."""
        return bool(processes) and all(
            p.returncode is None and p.pid in self._workers for p in processes
        )

    def settled(self, processes: Iterable[WorkerProcess]) -> bool:
        """Whether every worker of ``processes`` made its group of the current generation.
        One still making it is blocked in torch's store (its rank 0's, up to its timeout)
        and cannot follow a newer round: it is started again rather than kept."""
        return all(
            (w := self._workers.get(p.pid)) is not None and w.joined >= self.gen for p in processes
        )

    def broken_workers(self, processes: Iterable[WorkerProcess]) -> list[int]:
        """Pids of ``processes`` whose collective broke (waiting for the next round)."""
        return [
            p.pid for p in processes if (w := self._workers.get(p.pid)) and w.broken is not None
        ]

    def hold(self, processes: Iterable[WorkerProcess]) -> None:
        """Tell the workers that their group is changing (they leave it at once)."""
        for proc in processes:
            self._send(proc.pid, op="changing", gen=self.gen)

    def resume(self, envs: Mapping[int, Mapping[str, str]]) -> None:
        """Send each worker (pid -> its full environment) the ranks of its new group."""
        self.gen += 1
        self.told_fail = False
        self.broken.clear()
        self._broken_at = None
        for pid, env in envs.items():
            if (worker := self._workers.get(pid)) is not None:
                worker.broken = None  # the new round explains why its group broke
            round_env = {k: env[k] for k in ROUND_KEYS if k in env}
            self._send(pid, op="round", gen=self.gen, env=round_env)

    def fail(self, pids: Iterable[int]) -> None:
        """Tell waiting workers that no new group comes: they raise their own error."""
        for pid in pids:
            self._send(pid, op="fail")

    async def all_joined(self, pids: Sequence[int]) -> None:
        """Until every one of ``pids`` joined the current generation (or went away)."""
        while True:
            self.joined.clear()
            pending = [pid for pid in pids if (w := self._workers.get(pid)) and w.joined < self.gen]
            if not pending:
                return
            await self.joined.wait()

    def forget(self) -> None:
        """A new set of workers starts: the generation starts again."""
        self.gen = 0
        self.told_fail = False
        self.broken.clear()
        self._broken_at = None
        self._ending.clear()
        self._python_done.clear()
        self.failing.clear()

    def _send(self, pid: int, **message: Any) -> None:
        worker = self._workers.get(pid)
        if worker is None or worker.writer.is_closing():
            return
        worker.writer.write(json.dumps(message).encode() + b"\n")

    async def aclose(self) -> None:
        """Stop listening, drop the connections, remove the directory."""
        server, self._server = self._server, None
        for worker in self._workers.values():
            worker.writer.close()
        self._workers.clear()
        if server is not None:
            server.close()
            with contextlib.suppress(Exception):
                await wait_within(server.wait_closed(), 1.0)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
