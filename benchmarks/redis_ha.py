"""The rendezvous store with failover: Redis Sentinel against a standalone Redis, same run.

For each N (``--sizes``, default 16 and 256) and each store, the benchmark starts its own
servers on loopback (a standalone ``redis-server``; or a primary, one replica and three
sentinels from ``tests/_redis_ha.py``, the sentinels deciding after 1 s), and N rendezvous
nodes (handlers with their own connections, ``--procs`` worker processes of
``benchmarks/_ha_node.py``) plus one more node in a process of its own. Rules: min = N,
max = N + 1, so all N + 1 nodes complete a round at once.

* formation: wall time from the common start to the last of the N + 1 nodes completing;
* failover: the primary is SIGKILLed and, at the same moment, the extra node leaves the run,
  so the group must re-form without it: the time from the kill until the last of the N
  survivors completed the re-formed round (last call ``last_call_timeout`` = 0.5 s
  included). Standalone: the server is started again at once, empty (what a supervisor
  restarting a crashed Redis without persistence gives); Sentinel: a replica is promoted;
  Cluster (3 primaries with a replica each, ``cluster-node-timeout`` 2 s): the primary of the
  run's slot is killed and its replica takes over. Also shown: when the replica had been
  promoted (or the server was back).

Sentinel runs with the backend's default ``wait_replicas=1`` (``sentinel``) and without
waiting for replicas (``sentinel-nowait``, ``wait_replicas=0``): after the failover the new
primary has no replica, so with the default the first durable write of each node waits 1 s
for an acknowledgement that does not come (then the backend stops waiting for a while).

Run: ``python benchmarks/redis_ha.py [--sizes 16 256] [--json out.json]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._scale_node import raise_fd_limit
from benchmarks._scale_servers import ROOT

CONFIG = {
    "join_timeout": 600,
    "last_call_timeout": 0.5,
    "keep_alive_interval": 1,
    "keep_alive_max_attempt": 5,
    "read_timeout": 120,
    "share_connections": 0,
}
STORES = ("standalone", "sentinel", "sentinel-nowait", "cluster")
_SERVER_ARGS = ("--maxclients", "19000", "--tcp-backlog", "4096")
_TIMEOUT = 180.0


class Workers:
    """The node processes of one job and what they reported."""

    def __init__(self) -> None:
        self.procs: list[asyncio.subprocess.Process] = []
        self.events: list[tuple[int, dict[str, Any]]] = []
        self.changed = asyncio.Event()
        self._readers: list[asyncio.Task[None]] = []

    async def spawn(self, spec: dict[str, Any], count: int) -> None:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "benchmarks._ha_node",
            json.dumps({**spec, "count": count}),
            cwd=ROOT,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            limit=1 << 24,
        )
        index = len(self.procs)
        self.procs.append(proc)
        self._readers.append(asyncio.ensure_future(self._read(index, proc)))

    async def _read(self, index: int, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        async for line in proc.stdout:
            with contextlib.suppress(ValueError):
                self.events.append((index, json.loads(line)))
                self.changed.set()
        self.changed.set()

    def of(self, kind: str, **match: Any) -> list[tuple[int, dict[str, Any]]]:
        return [
            (p, e)
            for p, e in self.events
            if e["ev"] == kind and all(e.get(k) == v for k, v in match.items())
        ]

    async def until(self, check: Any, what: str) -> None:
        deadline = time.monotonic() + _TIMEOUT
        while not check():
            failed = self.of("failed")
            if failed:
                raise RuntimeError(f"{what}: a node failed: {failed[0][1]['error']}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"{what}: not within {_TIMEOUT:g} s")
            self.changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.changed.wait(), left)

    def send(self, index: int, **command: Any) -> None:
        stdin = self.procs[index].stdin
        assert stdin is not None
        stdin.write((json.dumps(command) + "\n").encode())

    async def close(self) -> None:
        for index in range(len(self.procs)):
            with contextlib.suppress(Exception):
                self.send(index, cmd="exit")
        for proc in self.procs:
            try:
                await asyncio.wait_for(proc.wait(), 30)
            except asyncio.TimeoutError:
                proc.kill()
                await proc.wait()
        for reader in self._readers:
            reader.cancel()


async def job(store: str, nodes: int, procs: int) -> dict[str, Any]:
    """One measured job: formation, then a failover (see the module docstring)."""
    from aelastic.backends.redis import RunKeys
    from tests._redis_ha import RedisCluster, SentinelGroup
    from tests._redis_server import RedisServer

    server: Any
    config = dict(CONFIG, wait_replicas=0) if store == "sentinel-nowait" else CONFIG
    if store.startswith("sentinel"):
        server = SentinelGroup(extra_args=_SERVER_ARGS).start()
        endpoint = server.endpoint
    elif store == "cluster":
        server = RedisCluster(extra_args=_SERVER_ARGS).start()
        endpoint = server.endpoint
    else:
        server = RedisServer(extra_args=_SERVER_ARGS).start()
        endpoint = server.url
    workers = Workers()
    try:
        run_id = f"ha-{uuid.uuid4().hex[:8]}"
        spec = {
            "endpoint": endpoint,
            "run_id": run_id,
            "min": nodes,
            "max": nodes + 1,
            "config": config,
        }
        counts = [nodes // procs + (1 if i < nodes % procs else 0) for i in range(procs)]
        for count in [c for c in counts if c] + [1]:  # the last process: the leaving node
            await workers.spawn(spec, count)
        leaver = len(workers.procs) - 1
        await workers.until(lambda: len(workers.of("ready")) == len(workers.procs), "start")
        at = time.time() + 1.0
        for index in range(len(workers.procs)):
            workers.send(index, cmd="form", at=at)
        await workers.until(lambda: len(workers.of("formed")) == nodes + 1, "formation")
        formation = max(e["t"] for _, e in workers.of("formed")) - at
        await asyncio.sleep(2.0)  # every node watching, its heartbeats going

        killed = time.time()
        if store.startswith("sentinel"):
            workers.send(leaver, cmd="leave")
            await asyncio.to_thread(server.kill_primary)
        elif store == "cluster":
            workers.send(leaver, cmd="leave")
            await asyncio.to_thread(server.kill_primary_of, RunKeys("aelastic", run_id).state)
        else:
            server.kill()
            workers.send(leaver, cmd="leave")
            await asyncio.to_thread(server.start)
        back = time.time() - killed

        def reformed() -> list[tuple[int, dict[str, Any]]]:
            return [(p, e) for p, e in workers.of("formed", world=nodes) if e["t"] > killed]

        await workers.until(lambda: len(reformed()) == nodes, "re-formation")
        failover = max(e["t"] for _, e in reformed()) - killed
        return {
            "store": store,
            "nodes": nodes,
            "formation_s": round(formation, 3),
            "primary_back_s": round(back, 3),
            "reformed_s": round(failover, 3),
        }
    finally:
        await workers.close()
        server.close()


def report(rows: list[dict[str, Any]]) -> str:
    lines = [
        "store             nodes  formation  primary back  re-formed round (from SIGKILL)",
    ]
    for r in rows:
        lines.append(
            f"{r['store']:<16} {r['nodes']:>6}  {r['formation_s']:>7.2f} s  "
            f"{r['primary_back_s']:>10.2f} s  {r['reformed_s']:>12.2f} s"
        )
    return "\n".join(lines)


async def amain(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for nodes in args.sizes:
        for store in args.stores:
            row = await job(store, nodes, max(1, min(args.procs, nodes)))
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 256])
    parser.add_argument("--stores", nargs="+", default=list(STORES), choices=STORES)
    parser.add_argument("--procs", type=int, default=4, help="worker processes per job")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    raise_fd_limit()
    rows = asyncio.run(amain(args))
    print(report(rows))
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "config": CONFIG}, indent=2) + "\n")


if __name__ == "__main__":
    main()
