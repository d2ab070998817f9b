"""One rendezvous node in a process of its own, for the departure tests.

``python _watching_node.py BACKEND ENDPOINT RUN_ID KEY=VALUE...``: joins a round of two nodes
and prints one JSON line per event: ``{"event": "ready", "rank": r, "pid": p}`` once the
round is complete, then ``{"event": "changed", "lost": n, "removed": b, "at": wall time}``
each time the group changes. A line ``check`` on stdin makes it ask the backend which members'
connections ended (as an agent does when a worker's collective broke) and print
``{"event": "checked", "lost": n, "took": seconds}``. Ends when stdin closes (then it leaves).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

from aelastic.rendezvous import RendezvousParameters, create_handler


def say(**doc: object) -> None:
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


async def main(backend: str, endpoint: str, run_id: str, conf: dict[str, str]) -> None:
    params = RendezvousParameters(backend, endpoint, run_id, 2, 2, local_addr="127.0.0.1", **conf)
    handler = create_handler(params)
    async with handler:
        info = await handler.next_rendezvous()
        say(event="ready", rank=info.rank, pid=os.getpid())
        loop = asyncio.get_running_loop()
        stdin: asyncio.Future[str] = loop.run_in_executor(None, sys.stdin.readline)

        async def commands() -> None:
            nonlocal stdin
            while line := await stdin:
                stdin = loop.run_in_executor(None, sys.stdin.readline)
                if line.strip() == "check":
                    began = time.monotonic()
                    lost = await handler.report_departures()
                    say(event="checked", lost=lost, took=time.monotonic() - began)

        async def changes() -> None:
            since = None
            while True:
                since = await handler.watch(0.0, since)
                say(event="changed", lost=since.lost_count, removed=since.removed, at=time.time())

        watching = asyncio.ensure_future(changes())
        await commands()
        watching.cancel()
        await handler.leave()


if __name__ == "__main__":
    backend, endpoint, run_id, *pairs = sys.argv[1:]
    asyncio.run(main(backend, endpoint, run_id, dict(p.split("=", 1) for p in pairs)))
