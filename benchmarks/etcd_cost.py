"""What each kind of request costs etcd's CPU, over the gRPC API aelastic speaks.

Run: ``python benchmarks/etcd_cost.py [--n 1024] [--clients 256] [--json FILE]``.

A real etcd on loopback (``tests/_etcd_server.py``); ``--clients`` clients of aelastic's own
etcd client (:class:`aelastic.backends.etcd._client.EtcdClient`, a connection each, as
separate hosts have), ``--n`` requests of each kind, 128 in flight. For each kind, the
etcd process's CPU (user + system, from ``/proc``) divided by the requests: what a node's
rendezvous spends of etcd's CPU is the sum of its requests' rows (docs/benchmarks.md, the
etcd section). The kinds, in the order run: a request on a new connection, the same on a
kept one, a count of an empty range and of N keys, a lease grant, a write on a lease, a
keep-alive request (a stream of its own), a keep-alive and a count sent at once, opening a
keep-alive stream,
a keep-alive on it, opening a watch, and one event sent to each of N watchers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aelastic.backends.etcd._answers import b64
from aelastic.backends.etcd._client import EtcdClient
from aelastic.backends.etcd._endpoint import parse_endpoint
from benchmarks._scale_servers import cpu_seconds
from tests._etcd_server import EtcdServer

Op = Callable[[EtcdClient, int], Awaitable[Any]]


async def measure(pid: int, name: str, clients: list[EtcdClient], op: Op, n: int) -> float:
    """etcd's CPU per call of ``op`` (ms), ``n`` calls spread over ``clients``."""
    gate = asyncio.Semaphore(128)

    async def one(i: int) -> None:
        async with gate:
            await op(clients[i % len(clients)], i)

    before, started = cpu_seconds(pid), time.monotonic()
    await asyncio.gather(*(one(i) for i in range(n)))
    cost = 1e3 * (cpu_seconds(pid) - before) / n
    print(f"{name:42s} {cost:6.3f} ms  ({time.monotonic() - started:.2f} s)", flush=True)
    return cost


async def run(endpoint: str, pid: int, n: int, count: int) -> dict[str, float]:
    ep = parse_endpoint(endpoint, {})
    base = f"/cost/{random.randrange(10**9)}/"
    p, p_end = b64(base + "p/"), b64(base + "p0")
    leases: dict[int, str] = {}
    results: dict[str, float] = {}
    stacks: list[AsyncExitStack] = []

    async def header(c: EtcdClient, i: int) -> None:
        await c.call("/v3/kv/range", {"key": b64(base + "h")}, "range")

    async def count_p(c: EtcdClient, i: int) -> None:
        body = {"key": p, "range_end": p_end, "count_only": True, "serializable": True}
        await c.call("/v3/kv/range", body, "count")

    async def grant(c: EtcdClient, i: int) -> None:
        leases[i] = (await c.call("/v3/lease/grant", {"TTL": 60}, "grant"))["ID"]

    async def put(c: EtcdClient, i: int) -> None:
        key = b64(f"{base}p/{i:08d}")
        body = {
            "compare": [{"key": key, "target": "MOD", "result": "EQUAL", "mod_revision": 0}],
            "success": [{"request_put": {"key": key, "value": b64("x" * 40), "lease": leases[i]}}],
        }
        await c.call("/v3/kv/txn", body, "put")

    async def keep_alive(c: EtcdClient, i: int) -> None:
        await c.call("/v3/lease/keepalive", {"ID": leases[i]}, "keep-alive")

    async def renew_and_rank(c: EtcdClient, i: int) -> None:
        rank = {"key": p, "range_end": b64(f"{base}p/{i:08d}"), "count_only": True,
                "serializable": True}  # fmt: skip
        await c.call_many(
            lambda: [("/v3/lease/keepalive", {"ID": leases[i]}), ("/v3/kv/range", rank)],
            "rank",
            ordered=False,
        )

    async def on_stream(c: EtcdClient, i: int) -> None:
        await c.keep_alive(int(leases[i]))

    async def watch(c: EtcdClient, i: int) -> None:
        stack = AsyncExitStack()
        stacks.append(stack)
        create = {"key": b64(base + "c"), "range_end": b64(base + "kv0"), "watch_id": 1}
        messages = await stack.enter_async_context(
            c.stream("/v3/watch", {"create_request": create})
        )
        async for _ in messages:  # "created"
            break

    connect_clients = [EtcdClient(ep, 60) for _ in range(n)]
    results["request on a new connection"] = await measure(
        pid, "request on a new connection", connect_clients, header, n
    )
    for c in connect_clients:
        await c.aclose()
    clients = [EtcdClient(ep, 60) for _ in range(count)]
    await asyncio.gather(*(header(c, 0) for c in clients))  # connected
    steps: list[tuple[str, Op, int]] = [
        ("request on a kept connection", header, n),
        ("count of an empty range", count_p, n),
        ("lease grant", grant, n),
        ("write on a lease (txn)", put, n),
        (f"count of {n} keys", count_p, n),
        ("keep-alive request", keep_alive, n),
        ("keep-alive + rank count, at once", renew_and_rank, n),
        ("open a keep-alive stream, one renewal on it", on_stream, count),
        ("keep-alive on the stream", on_stream, n),
        ("open a watch (until 'created')", watch, count),
    ]
    for name, op, times in steps:
        results[name] = await measure(pid, name, clients, op, times)
    before = cpu_seconds(pid)
    await clients[0].call("/v3/kv/put", {"key": b64(base + "h"), "value": b64("y" * 200)}, "w")
    await asyncio.sleep(2.0)  # every watcher's event sent
    results["one event to each watcher"] = 1e3 * (cpu_seconds(pid) - before) / count
    print(f"{'one event to each watcher':42s} {results['one event to each watcher']:6.3f} ms")
    for stack in stacks:
        await stack.aclose()
    for c in clients:
        await c.aclose()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=1024, help="requests of each kind")
    parser.add_argument("--clients", type=int, default=256, help="clients (connections)")
    parser.add_argument("--json", type=Path, help="save the results here")
    args = parser.parse_args()
    with EtcdServer() as etcd:
        assert etcd.process is not None
        print(f"etcd's CPU per request (n={args.n}, {args.clients} clients, load "
              f"{os.getloadavg()[0]:.1f})", flush=True)  # fmt: skip
        results = asyncio.run(run(etcd.endpoint, etcd.process.pid, args.n, args.clients))
    if args.json:
        doc = {"n": args.n, "clients": args.clients, "ms_of_etcd_cpu": results,
               "load_average": os.getloadavg()}  # fmt: skip
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
