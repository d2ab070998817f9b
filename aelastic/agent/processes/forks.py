"""Callable workers under the ``fork`` start method: forked from a server, not from the loop.

How it works: a worker forked from the agent's event-loop thread would inherit whatever
locks the agent's other threads held at that instant (a resolver, a logging handler, an
executor's queue) and could hang on its first use of them. So :meth:`ForkServer.start`,
called before the loop and its threads start (``run_sync``, the launcher) or first thing in
``run()``, forks a small server off the caller with multiprocessing's ``fork`` context. It
holds the caller's memory as it was (the function, its arguments, lambdas, closures, a
notebook's ``__main__``), runs no loop and no thread, and forks each worker on request,
again through multiprocessing's ``fork`` context (so ``mp.Queue`` and friends are reset in
the child as multiprocessing does). A worker starts its own session, asks for SIGKILL when
the server dies (the server asks the same of the agent), takes its stdout/stderr, its
environment and its CPUs, and runs :func:`aelastic.agent.processes._call.call`.

Two socket pairs join agent and server: requests (a job as JSON plus the stream
descriptors, SCM_RIGHTS; answered at once with the pid, a blocking round trip the length of
a ``fork``, as long as ``subprocess.Popen`` blocks) and exits (the server reaps its
workers and sends ``{"pid", "code"}``, read on the agent's loop). The agent adopts each
worker (:meth:`WorkerProcess.adopted`): the guardian watches its process group, and the
stop (SIGTERM, grace, SIGKILL) is the same as for any worker. End-of-file on the requests
ends the server; the server's death ends its workers (SIGKILL).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import os
import signal
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ...core.race import wait_within
from ...worker._site import _aelastic_guard as guard
from ...worker._site import _aelastic_worker as progress_runtime
from ..api import WorkerSpec
from ._call import call
from .env import substitute_args
from .process import WorkerProcess, child_setup

__all__ = ["ForkServer", "fork_server_for"]

_MAX_MESSAGE = 1 << 22
#: Seconds the server gets to exit once told to (it exits at once).
_SERVER_EXIT = 5.0


class ForkServer:
    """A process forked off the caller that forks the workers of ``fn(*args)``.

    Args:
        fn: The workers' function.
        args: Its arguments (``${local_rank}`` in strings becomes the worker's local rank).
    """

    def __init__(self, fn: Callable[..., Any], args: Sequence[Any]) -> None:
        self._fn = fn
        self._args = tuple(args)
        self._process: Any = None
        self._requests: socket.socket | None = None
        self._exits: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._workers: dict[int, WorkerProcess] = {}

    def __repr__(self) -> str:
        pid = None if self._process is None else self._process.pid
        return f"ForkServer(pid={pid}, workers={sorted(self._workers)})"

    @property
    def started(self) -> bool:
        return self._process is not None

    def start(self) -> None:
        """Fork the server now, from the caller's current state (idempotent).

        Raises:
            OSError: The server could not be forked.
        """
        if self._process is not None:
            return
        requests, their_requests = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        exits, their_exits = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours = (requests, exits)
        theirs = (their_requests, their_exits)
        process = multiprocessing.get_context("fork").Process(
            target=_serve,
            args=(theirs, ours, self._fn, self._args, child_setup(None)),
            name="aelastic-fork-server",
        )
        try:
            process.start()
        except BaseException:
            for sock in (*ours, *theirs):
                sock.close()
            raise
        for sock in theirs:
            sock.close()
        self._process, self._requests, self._exits = process, requests, exits

    def spawn(
        self,
        local_rank: int,
        env: Mapping[str, str],
        result: str,
        streams: Sequence[int | None],
        *,
        affinity: frozenset[int] | None = None,
    ) -> WorkerProcess:
        """Fork the worker of ``local_rank`` (call on the agent's event loop).

        Args:
            local_rank: The worker's local rank.
            env: Its whole environment.
            result: Where its return value is written.
            streams: Descriptors for its stdout and stderr (``None``: the agent's).
            affinity: The CPUs it binds itself to.

        Raises:
            OSError: The server is gone or could not fork.
        """
        if self._requests is None or self._exits is None:
            raise OSError("the fork server is not running")
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
            loop.add_reader(self._exits.fileno(), self._on_exit)
        job = {
            "local_rank": local_rank,
            "env": dict(env),
            "result": result,
            "dup": [target for target, fd in zip((1, 2), streams, strict=True) if fd is not None],
            "affinity": None if affinity is None else sorted(affinity),
        }
        fds = [fd for fd in streams if fd is not None]
        WorkerProcess.before_spawn()
        socket.send_fds(self._requests, [json.dumps(job).encode()], fds)
        answer = json.loads(self._requests.recv(_MAX_MESSAGE) or b"{}")
        if "pid" not in answer:
            raise OSError(answer.get("error", "the fork server is gone"))
        proc = WorkerProcess.adopted(int(answer["pid"]), local_rank)
        self._workers[proc.pid] = proc
        return proc

    def _on_exit(self) -> None:
        assert self._exits is not None
        try:
            data = self._exits.recv(_MAX_MESSAGE)
        except OSError:
            data = b""
        if not data:  # the server is gone: its workers got SIGKILL from the kernel
            self._detach()
            for proc in self._workers.values():
                proc.exited(-signal.SIGKILL)
            self._workers.clear()
            return
        message = json.loads(data)
        gone = self._workers.pop(int(message["pid"]), None)
        if gone is not None:
            gone.exited(int(message["code"]))

    def _detach(self) -> None:
        if self._loop is not None and self._exits is not None:
            with contextlib.suppress(ValueError, OSError, RuntimeError):
                self._loop.remove_reader(self._exits.fileno())
        self._loop = None

    async def aclose(self) -> None:
        """Stop the server (its workers stopped first) and reap it, without blocking."""
        self._detach()
        for sock in (self._requests, self._exits):
            if sock is not None:
                sock.close()
        self._requests = self._exits = None
        process, self._process = self._process, None
        if process is None:
            return
        loop = asyncio.get_running_loop()
        gone: asyncio.Future[None] = loop.create_future()

        def on_exit() -> None:
            if not gone.done():
                gone.set_result(None)

        loop.add_reader(process.sentinel, on_exit)
        try:
            await wait_within(gone, _SERVER_EXIT)
        except TimeoutError:
            process.kill()
        finally:
            loop.remove_reader(process.sentinel)
        process.join()


def fork_server_for(spec: WorkerSpec) -> ForkServer | None:
    """A started fork server for ``spec`` if it runs a callable under ``fork``, else ``None``.

    Raises:
        OSError: The server could not be forked.
    """
    entry = spec.entrypoint
    if spec.start_method != "fork" or not callable(entry):
        return None
    server = ForkServer(entry, spec.args)
    server.start()
    return server


def _serve(
    theirs: tuple[socket.socket, socket.socket],
    ours: tuple[socket.socket, socket.socket],
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    setup: Callable[[], None] | None,
) -> None:
    """The server's loop (in the forked server)."""
    if setup is not None:
        setup()  # SIGKILL when the agent dies
    os.setsid()  # terminal signals are the agent's business
    for sock in ours:
        sock.close()
    requests, exits = theirs
    from multiprocessing.connection import wait

    ctx = multiprocessing.get_context("fork")
    running: dict[Any, Any] = {}  # sentinel -> Process
    while True:
        for ready in wait([requests, *running]):
            if ready is requests:
                try:
                    msg, fds, _flags, _addr = socket.recv_fds(requests, _MAX_MESSAGE, 2)
                except OSError:
                    msg, fds = b"", []
                if not msg:
                    os._exit(0)  # the agent is done (or gone): the workers go with us
                job = json.loads(msg)
                process = ctx.Process(
                    target=_worker,
                    args=(job, fds, theirs, fn, args, child_setup(_affinity(job))),
                    name=f"aelastic-worker-{job['local_rank']}",
                )
                try:
                    process.start()
                except OSError as exc:
                    requests.send(json.dumps({"error": f"cannot fork: {exc}"}).encode())
                    continue
                finally:
                    for fd in fds:
                        os.close(fd)
                running[process.sentinel] = process
                requests.send(json.dumps({"pid": process.pid}).encode())
            else:
                process = running.pop(ready)
                process.join()
                exits.send(json.dumps({"pid": process.pid, "code": process.exitcode}).encode())


def _affinity(job: Mapping[str, Any]) -> frozenset[int] | None:
    cpus = job.get("affinity")
    return None if cpus is None else frozenset(cpus)


def _worker(
    job: Mapping[str, Any],
    fds: list[int],
    sockets: tuple[socket.socket, socket.socket],
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    setup: Callable[[], None] | None,
) -> None:
    """A worker, in the child the server forked."""
    os.setsid()
    if setup is not None:
        setup()  # SIGKILL when the server dies; the worker's CPUs
    for sock in sockets:
        sock.close()
    for target, fd in zip(job["dup"], fds, strict=False):
        os.dup2(fd, target)
        os.close(fd)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(job["env"])
    progress_runtime.forked_worker()  # what the bootstrap does in a new interpreter
    guard.watch_agent()
    sys.exit(call(fn, substitute_args(args, int(job["local_rank"])), job["result"]))
