"""One worker process of ``redis_ha.py``: some rendezvous nodes living through a failover.

Run as ``python -m benchmarks._ha_node SPEC`` (SPEC is JSON: endpoint, run_id, min, max,
count, config). Every node is a handler of its own (``share_connections=0``), a task of this
process's event loop. Protocol, one JSON object a line. On stdin: ``{"cmd": "form", "at": T}``
(every node calls ``next_rendezvous`` at wall-clock time T, then ``watch()``es, and joins the
next round whenever the group changed), ``{"cmd": "leave"}`` (every node leaves the run),
``{"cmd": "exit"}``. On stdout: ``ready``, then a ``formed`` event (node, time, world size)
for every round a node completed, ``failed`` for an error, and ``bye``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import time
from typing import Any

from aelastic import RendezvousParameters
from aelastic.rendezvous import create_handler
from benchmarks._scale_node import Emitter, raise_fd_limit


async def _life(index: int, handler: Any, at: float, emit: Emitter) -> None:
    await asyncio.sleep(max(at - time.time(), 0.0))
    try:
        while True:
            info = await handler.next_rendezvous()
            emit(ev="formed", i=index, t=time.time(), world=info.world_size, rank=info.rank)
            view = await handler.watch()
            if view.closed:
                return
    except Exception as exc:
        emit(ev="failed", i=index, t=time.time(), error=repr(exc))


async def main(spec: dict[str, Any]) -> None:
    emit = Emitter()
    params = RendezvousParameters(
        "redis",
        spec["endpoint"],
        spec["run_id"],
        spec["min"],
        spec["max"],
        local_addr="127.0.0.1",
        **spec["config"],
    )
    handlers = [create_handler(params) for _ in range(spec["count"])]
    lives: list[asyncio.Task[None]] = []
    emit(ev="ready")
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := await reader.readline():
        command = json.loads(line)
        if command["cmd"] == "form":
            lives = [
                asyncio.ensure_future(_life(i, h, command["at"], emit))
                for i, h in enumerate(handlers)
            ]
        elif command["cmd"] == "leave":
            for life in lives:
                life.cancel()
            await asyncio.gather(*(h.leave() for h in handlers), return_exceptions=True)
            emit(ev="left", t=time.time())
        elif command["cmd"] == "exit":
            break
    for life in lives:
        life.cancel()
    await asyncio.gather(*lives, return_exceptions=True)
    for handler in handlers:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(handler.aclose(), 10)
    emit(ev="bye")


if __name__ == "__main__":
    logging.basicConfig(level=logging.ERROR)
    raise_fd_limit()
    asyncio.run(main(json.loads(sys.argv[1])))
