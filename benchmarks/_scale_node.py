"""One worker process of ``rdzv_scale.py``: its share of the simulated rendezvous nodes.

Run by the benchmark as ``python -m benchmarks._scale_node SPEC`` (SPEC is JSON: backend,
endpoint, run_id, nodes (the job's size), count (nodes in this process), isolation, loop
(``asyncio`` or ``uvloop``), config).
Every node is a handler of its own, created with ``share_connections=0``. Isolation ``loop``
runs this process's nodes as tasks of one event loop (the backend must then honour
``share_connections=0``); ``thread`` gives each node its own event loop in its own thread,
so that a backend that shares connections per event loop cannot share them either.

Protocol, one JSON object a line. On stdin: ``{"cmd": "form", "at": T}`` (every node calls
``next_rendezvous`` at wall-clock time T, then runs ``watch()`` in a loop), ``{"cmd": "stats"}``,
``{"cmd": "exit"}`` (or end of input). On stdout: ``ready``, then per node ``formed`` or
``failed``, a ``watch`` event for every ``watch()`` return, ``watch_error``, ``stats`` answers,
and ``bye``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import resource
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from aelastic import RendezvousParameters
from aelastic.rendezvous import create_handler

_EXIT_GRACE = 20.0  # seconds the nodes get to release their connections at exit


def raise_fd_limit() -> None:
    """Raise this process's soft limit of open files to the hard limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


class Emitter:
    """Writes one JSON object a line to stdout (from any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def __call__(self, **event: Any) -> None:
        line = json.dumps(event, separators=(",", ":")) + "\n"
        with self._lock:
            sys.stdout.write(line)
            sys.stdout.flush()


def wakeup_counter(handler: Any) -> Callable[[], int]:
    """A function giving how many times this node's waits were woken so far.

    A wake-up is a notification (or a long-poll answer) that reached the node. Uses the
    handler's own ``stats.wakeups`` when it keeps one; otherwise counts the returns of the
    backend's ``wait_for_change`` that came before its timeout (a timeout is the node's own
    timer, not a wake-up). -1 when neither can be observed.
    """
    stats = getattr(handler, "stats", None)
    if isinstance(getattr(stats, "wakeups", None), int):
        return lambda: int(stats.wakeups)
    backend = getattr(handler, "backend", None)
    wait = getattr(backend, "wait_for_change", None)
    if wait is None:
        return lambda: -1
    count = 0

    async def counting_wait(token: Any, timeout: float | None) -> None:
        nonlocal count
        started = time.monotonic()
        await wait(token, timeout)
        if timeout is None or time.monotonic() - started < timeout - 0.001:
            count += 1

    backend.wait_for_change = counting_wait
    return lambda: count


def describe_view(view: Any) -> dict[str, Any]:
    """A membership view as JSON (members as text and, where they have one, their pid)."""
    lost = sorted(view.lost, key=str)
    return {
        "round": view.round,
        "closed": view.closed,
        "removed": view.removed,
        "waiting": view.waiting,
        "lost": [str(m) for m in lost],
        "lost_pids": [getattr(m, "pid", None) for m in lost],
    }


class Node:
    """One simulated node: its handler's life, driven from the worker's main thread."""

    def __init__(self, index: int, spec: dict[str, Any], emit: Emitter) -> None:
        self.index = index
        self._spec = spec
        self._emit = emit
        self.wakeups: Callable[[], int] = lambda: 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self._at = 0.0
        self._go: asyncio.Event | None = None
        self._stop: asyncio.Event | None = None

    def start(self, at: float) -> None:
        """Form at wall-clock time ``at`` (call in the node's loop)."""
        assert self._go is not None
        self._at = at
        self._go.set()

    def stop(self) -> None:
        """End the node (call in the node's loop)."""
        assert self._stop is not None
        self._stop.set()

    async def run(self, registered: Callable[[], None]) -> None:
        self.loop = asyncio.get_running_loop()
        self._go, self._stop = asyncio.Event(), asyncio.Event()
        spec = self._spec
        try:
            params = RendezvousParameters(
                spec["backend"],
                spec["endpoint"],
                spec["run_id"],
                spec["nodes"],
                spec["nodes"],
                local_addr="127.0.0.1",
                **spec["config"],
            )
            handler = create_handler(params)
            self.wakeups = wakeup_counter(handler)
        except Exception as exc:
            self._emit(ev="failed", i=self.index, t=time.time(), error=repr(exc))
            registered()
            return
        registered()
        life = asyncio.ensure_future(self._life(handler))
        await self._stop.wait()
        life.cancel()
        with contextlib.suppress(BaseException):
            await life
        with contextlib.suppress(Exception):
            await asyncio.wait_for(handler.aclose(), _EXIT_GRACE / 2)

    async def _life(self, handler: Any) -> None:
        assert self._go is not None
        await self._go.wait()
        await asyncio.sleep(max(self._at - time.time(), 0.0))
        try:
            info = await handler.next_rendezvous()
        except Exception as exc:
            self._emit(ev="failed", i=self.index, t=time.time(), error=repr(exc))
            return
        name = str(getattr(handler, "node", ""))
        self._emit(
            ev="formed",
            i=self.index,
            t=time.time(),
            rank=info.rank,
            world=info.world_size,
            node=name,
        )
        view = None
        while True:
            try:
                view = await handler.watch(since=view)
            except Exception as exc:
                self._emit(ev="watch_error", i=self.index, t=time.time(), error=repr(exc))
                await asyncio.sleep(1.0)
                continue
            self._emit(ev="watch", i=self.index, t=time.time(), view=describe_view(view))


def _run_group(nodes: list[Node], registered: Callable[[], None], loop: str) -> None:
    async def main() -> None:
        await asyncio.gather(*(node.run(registered) for node in nodes))

    if loop == "uvloop":
        import uvloop

        uvloop.run(main())
    else:
        asyncio.run(main())


def main() -> int:
    # Warnings of aelastic's loggers (a heartbeat that failed...) reach the worker's log
    # with their level and time, where the harness counts them.
    logging.basicConfig(
        level=logging.WARNING, format="%(created).3f %(levelname)s %(name)s: %(message)s"
    )
    spec = json.loads(sys.argv[1])
    raise_fd_limit()
    emit = Emitter()
    nodes = [Node(i, spec, emit) for i in range(spec["count"])]
    groups = [[n] for n in nodes] if spec["isolation"] == "thread" else [nodes]
    done = threading.Semaphore(0)
    threads = [
        threading.Thread(
            target=_run_group,
            args=(group, done.release, spec.get("loop", "asyncio")),
            daemon=True,
        )
        for group in groups
    ]
    for thread in threads:
        thread.start()
    for _ in nodes:
        done.acquire()
    emit(ev="ready", pid=os.getpid(), count=len(nodes))
    for line in sys.stdin:
        command = json.loads(line)
        if command["cmd"] == "form":
            for node in nodes:
                if node.loop is not None:
                    with contextlib.suppress(RuntimeError):  # a node that failed has no loop
                        node.loop.call_soon_threadsafe(node.start, command["at"])
        elif command["cmd"] == "stats":
            emit(ev="stats", wakeups=sum(node.wakeups() for node in nodes), t=time.time())
        elif command["cmd"] == "exit":
            break
    for node in nodes:
        if node.loop is not None:
            with contextlib.suppress(RuntimeError):  # its loop already ended
                node.loop.call_soon_threadsafe(node.stop)
    deadline = time.monotonic() + _EXIT_GRACE
    for thread in threads:
        thread.join(max(deadline - time.monotonic(), 0.0))
    emit(ev="bye", clean=not any(t.is_alive() for t in threads))
    sys.stderr.flush()
    os._exit(0)  # threads still releasing connections are not waited for


if __name__ == "__main__":
    sys.exit(main())
