"""Redis backend probe: formation time in one process, and raw wake-up latency.

* formation: N handlers (min = max = N) as tasks of one event loop over a real
  redis-server, each with its own backend from ``create_handler``; median of a few runs;
* wake-up: waiters parked in ``wait_for_change`` while another client (a thread with its
  own connection, i.e. another process in effect) writes the state with the backend's own
  compare-and-set script; time from just before the write to each waiter's return. The
  safety-net re-read is set to 60 s, so every wake-up is a pub/sub notification.

Run: ``python benchmarks/redis_formation_probe.py [--sizes 16,256] [--runs 3]``
(the main comparison with torch is ``benchmarks/rdzv_formation.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aelastic import RendezvousParameters
from aelastic.backends.redis import _scripts, create_backend
from aelastic.rendezvous import create_handler
from tests._redis_server import RedisServer

CONF = {"join_timeout": 600, "last_call_timeout": 30, "read_timeout": 60}


async def formation(url: str, n: int) -> float:
    """Seconds for ``n`` handlers to form one round."""
    run_id = f"probe-{uuid.uuid4().hex[:8]}"
    params = RendezvousParameters("redis", url, run_id, n, n, local_addr="127.0.0.1", **CONF)
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


async def wakeup(server: RedisServer, waiters: int, samples: int) -> list[float]:
    """Milliseconds from a foreign write to each parked waiter's return."""
    run_id = f"wake-{uuid.uuid4().hex[:8]}"
    params = RendezvousParameters("redis", server.url, run_id, 1, 1, recheck_interval=60)
    backends = [create_backend(params) for _ in range(waiters)]
    keys = backends[0].keys
    client = server.client()
    cas = client.register_script(_scripts.CAS)
    latencies: list[float] = []
    try:
        _, _, token = await backends[0].compare_and_set(b"0", "")
        for i in range(samples):
            parked = [asyncio.ensure_future(b.wait_for_change(token, 30)) for b in backends]
            await asyncio.sleep(0.05)  # let every waiter park
            assert not any(p.done() for p in parked)
            written_at: list[float] = []
            args = [token, str(i + 1).encode(), "beef", 60_000, keys.channel]

            def write(args: list[object] = args, written_at: list[float] = written_at) -> None:
                written_at.append(time.perf_counter())
                cas(keys=[keys.state], args=args)

            writer = threading.Thread(target=write)
            writer.start()
            returned = []
            for p in asyncio.as_completed(parked):
                await p
                returned.append(time.perf_counter())
            writer.join()
            latencies += [(t - written_at[0]) * 1000 for t in returned]
            token = (await backends[0].read())[1]
    finally:
        client.close()
        for b in backends:
            await b.aclose()
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="16,256")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=20)
    args = parser.parse_args()
    with RedisServer() as server:
        print("formation over Redis, one process (median of runs)")
        for n in (int(s) for s in args.sizes.split(",")):
            times = [asyncio.run(formation(server.url, n)) for _ in range(args.runs)]
            shown = " ".join(f"{t:.3f}" for t in times)
            print(f"  N={n:4d}: {statistics.median(times):.3f} s   (runs: {shown})")
        print("wake-up latency: foreign write -> parked waiter returns (ms)")
        for waiters in (1, 64):
            ms = sorted(asyncio.run(wakeup(server, waiters, args.samples)))
            p90 = ms[int(len(ms) * 0.9) - 1]
            print(
                f"  {waiters:3d} waiter(s): median {statistics.median(ms):.2f}  p90 {p90:.2f}"
                f"  max {ms[-1]:.2f}"
            )


if __name__ == "__main__":
    main()
