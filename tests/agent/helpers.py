"""Helpers for the agent tests: a hub the test workers report to, specs, process checks."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from aelastic.agent import ElasticAgent, RunResult, WorkerSpec
from aelastic.rendezvous import DynamicRendezvousHandler, RendezvousParameters, create_handler

WORKER = str(Path(__file__).with_name("worker.py"))
TIMEOUT = 60.0


class WorkerHub:
    """A loopback server the test workers (``worker.py``) connect to, one line each way."""

    def __init__(self) -> None:
        self._hellos: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._writers: dict[int, asyncio.StreamWriter] = {}
        self._server: asyncio.Server | None = None
        self.port = 0

    async def __aenter__(self) -> WorkerHub:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        for writer in self._writers.values():
            writer.close()
        for writer in self._writers.values():
            with contextlib.suppress(Exception):
                await writer.wait_closed()
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    @property
    def env(self) -> dict[str, str]:
        """The environment that tells a worker where the hub is."""
        return {"AELASTIC_TEST_HUB": f"127.0.0.1:{self.port}"}

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        line = await reader.readline()
        if not line:
            writer.close()
            return
        hello = json.loads(line)
        self._writers[hello["pid"]] = writer
        await self._hellos.put(hello)

    async def next(self, timeout: float = TIMEOUT) -> dict[str, Any]:
        """The next worker that reported."""
        return await asyncio.wait_for(self._hellos.get(), timeout)

    async def gather(self, count: int, timeout: float = TIMEOUT) -> list[dict[str, Any]]:
        """The next ``count`` reports, sorted by global rank."""
        hellos = [await self.next(timeout) for _ in range(count)]
        return sorted(hellos, key=lambda h: h["rank"])

    def tell(self, pid: int, command: str) -> None:
        """Send ``command`` (``exit N``, ``raise MSG``) to a worker."""
        self._writers[pid].write(command.encode() + b"\n")

    def release(self, pid: int) -> None:
        """Let a worker exit 0."""
        self._writers.pop(pid).close()

    def pending(self) -> int:
        """Reports not consumed yet."""
        return self._hellos.qsize()


def make_handler(
    run_id: str,
    min_nodes: int = 1,
    max_nodes: int = 1,
    backend: str = "memory",
    endpoint: str = "agent-tests",
    **config: Any,
) -> DynamicRendezvousHandler:
    """An async rendezvous handler with short timeouts suited to tests."""
    config.setdefault("last_call_timeout", 0.2)
    config.setdefault("join_timeout", 30)
    params = RendezvousParameters(backend, endpoint, run_id, min_nodes, max_nodes, **config)
    return create_handler(params)


def worker_spec(
    handler: DynamicRendezvousHandler,
    hub: WorkerHub,
    mode: str = "report",
    nproc: int = 2,
    *args: str,
    **kwargs: Any,
) -> WorkerSpec:
    """A spec running ``worker.py MODE ARGS`` reporting to ``hub``."""
    env = {**hub.env, **kwargs.pop("env", {})}
    kwargs.setdefault("stop_grace_period", 10.0)
    kwargs.setdefault("max_restarts", 0)
    return WorkerSpec(
        role="trainer",
        local_world_size=nproc,
        rdzv_handler=handler,
        entrypoint=sys.executable,
        args=(WORKER, mode, *args),
        env=env,
        **kwargs,
    )


@contextlib.asynccontextmanager
async def running(agent: ElasticAgent) -> AsyncIterator[asyncio.Task[RunResult]]:
    """Run ``agent`` in a task; cancel it on the way out if it is still running."""
    task = asyncio.ensure_future(agent.run())
    try:
        yield task
    finally:
        if not task.done():
            task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(task, TIMEOUT)


def reaped(pid: int) -> bool:
    """Whether a child of this process is gone and reaped: no process, no zombie."""
    return not os.path.exists(f"/proc/{pid}")


def not_running(pid: int) -> bool:
    """Whether ``pid`` (not necessarily our child) is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


def children() -> dict[int, str]:
    """This process's children, zombies included: pid to command line."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid():
            found[int(entry.name)] = cmdline.strip()
    return found


def own_dir(root: Path | str, run_id: str) -> Path:
    """The one log directory an agent made for ``run_id`` under ``root``: torch's layout,
    ``<root>/<run_id>_<random>``."""
    [found] = Path(root).glob(f"{run_id}_*")
    return found
