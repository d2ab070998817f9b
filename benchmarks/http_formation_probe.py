"""Probe of the HTTP backend: formation time and wake-up latency, one process, real server.

* formation: N handlers (asyncio tasks of one loop, min = max = N) over one
  ``python -m aelastic.backends.http.server`` subprocess on loopback; median of a few runs;
* wake-up: W backends wait (long-poll) on the state; a writer on its own session changes
  it; the time from the writer's acknowledged write to the last waiter's return.

Run: ``python benchmarks/http_formation_probe.py [--sizes 16,256] [--waiters 1,256]``
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aelastic import RendezvousParameters
from aelastic.backends.http.client import HttpBackend
from aelastic.rendezvous import create_handler
from tests._http_server import HttpServer

CONF = {"join_timeout": 600, "last_call_timeout": 30, "read_timeout": 60}


async def formation(url: str, n: int) -> float:
    run_id = f"probe-{uuid.uuid4().hex[:8]}"
    params = RendezvousParameters("http", url, run_id, n, n, local_addr="127.0.0.1", **CONF)
    handlers = [create_handler(params) for _ in range(n)]
    try:
        start = time.perf_counter()
        infos = await asyncio.gather(*(h.next_rendezvous() for h in handlers))
        elapsed = time.perf_counter() - start
        assert sorted(i.rank for i in infos) == list(range(n))
        return elapsed
    finally:
        for h in handlers:
            await h.aclose()


async def wakeup(port: int, waiters: int, samples: int) -> list[float]:
    run_id = f"wake-{uuid.uuid4().hex[:8]}"
    # The writer uses another host name, hence another session: nothing is shared in-process.
    writer = HttpBackend(run_id, f"localhost:{port}")
    readers = [HttpBackend(run_id, f"127.0.0.1:{port}") for _ in range(waiters)]
    try:
        _, _, token = await writer.compare_and_set(b"0", "")
        results = []
        for i in range(samples):
            await asyncio.gather(*(r.read() for r in readers))
            waiting = [asyncio.ensure_future(r.wait_for_change(token, 30)) for r in readers]
            await asyncio.sleep(0.05)  # the long-polls are now held by the server
            written, _, token = await writer.compare_and_set(str(i + 1).encode(), token)
            acked = time.perf_counter()
            assert written
            await asyncio.gather(*waiting)
            results.append(time.perf_counter() - acked)
        return results
    finally:
        for b in [writer, *readers]:
            await b.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="16,256")
    parser.add_argument("--waiters", default="1,256")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with HttpServer() as server:
        for n in (int(s) for s in args.sizes.split(",")):
            times = [asyncio.run(formation(server.url, n)) for _ in range(args.repeat)]
            print(
                f"formation N={n:4}: median {statistics.median(times):.3f} s  "
                f"(runs: {', '.join(f'{t:.3f}' for t in times)})",
                flush=True,
            )
        for w in (int(s) for s in args.waiters.split(",")):
            lat = asyncio.run(wakeup(server.port, w, 5 * args.repeat))
            print(
                f"wake-up W={w:4}: median {statistics.median(lat) * 1000:.2f} ms, "
                f"max {max(lat) * 1000:.2f} ms (write acknowledged -> last waiter returns)"
            )


if __name__ == "__main__":
    main()
