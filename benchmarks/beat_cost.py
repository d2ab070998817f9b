"""What one heartbeat costs a Redis server: its script's CPU, its reply's bytes, memory per node.

A real ``redis-server`` holds one run of N nodes (joined and completed through aelastic's own
script). Then ``--beats`` keep-alives of random members are sent, pipelined, twice: down the
script's whole path (no beat key: what every heartbeat ran before the short path) and down
the short path (with the beat key of the run's status, as a node sends it). For each: Redis'
own time per script call (``INFO commandstats``, ``usec_per_call``), the redis-server
process's CPU per beat (``/proc``), the bytes Redis sent per beat, and the beats per second
one Redis core carries at that CPU. Memory: ``used_memory`` beyond the empty server, per node.

The nodes' side is not measured here (see ``rdzv_scale.py``, which runs real nodes); this
isolates the store's per-beat work, the cost that bounds how many nodes one Redis core
carries at 1 s beats.

Run: ``python benchmarks/beat_cost.py --nodes 4096 16384 --beats 40000``
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aelastic.backends.redis import _lua, _scripts
from aelastic.core.brief import beat_key
from aelastic.core.params import Rules
from aelastic.core.wire import status_from_json
from benchmarks._scale_servers import cpu_seconds
from tests._redis_server import RedisServer

_SECRET = "5ec2e7" * 6
_BATCH = 500


def _args(op: str, node: str, rules: Rules, ttl: int, channel: str, key: str) -> list[Any]:
    return [
        op, node, rules.min_nodes, rules.max_nodes, rules.last_call_ms, rules.window_ms,
        "0", "0", 1, "", "e" * 16, ttl, channel, "0", _SECRET, "0", key,
    ]  # fmt: skip


def _stats(client: Any) -> tuple[int, int, int]:
    """Script calls, their usec, and Redis' bytes out so far."""
    calls = usec = 0
    for name, value in client.info("commandstats").items():
        if name.removeprefix("cmdstat_") in ("evalsha", "eval"):
            calls += int(value["calls"])
            usec += int(value["usec"])
    return calls, usec, int(client.info("stats")["total_net_output_bytes"])


def measure(n: int, beats: int) -> dict[str, Any]:
    with RedisServer(extra_args=("--maxclients", "19000")) as server:
        assert server.process is not None
        client = server.client()
        empty = int(client.info("memory")["used_memory"])
        keys = _scripts.RunKeys("aelastic", f"beat-cost-{n}")
        sha = client.script_load(_lua.OP)
        rules = Rules(n, n, last_call_ms=60_000, window_ms=600_000)
        ttl, nkeys = 24 * 3600 * 1000, len(keys.rendezvous)
        nodes = [f"10.{i // 65536}.{i // 256 % 256}.{i % 256}_{1000 + i}_0" for i in range(n)]
        last: Any = None
        for start in range(0, n, _BATCH):
            pipe = client.pipeline(transaction=False)
            for node in nodes[start : start + _BATCH]:
                args = _args("join", node, rules, ttl, keys.channel, "")
                pipe.evalsha(sha, nkeys, *keys.rendezvous, *args)
            last = pipe.execute()[-1]
        status = status_from_json(json.loads(last)["status"])
        assert status.complete and status.world == n, status
        memory = int(client.info("memory")["used_memory"]) - empty
        result: dict[str, Any] = {"n": n, "memory_per_node": memory / n, "beats": beats}
        rng = random.Random(1)
        for path, key in (("whole", ""), ("short", beat_key(status))):
            calls0, usec0, out0 = _stats(client)
            cpu0, t0 = cpu_seconds(server.process.pid), time.perf_counter()
            sample = b""
            for start in range(0, beats, _BATCH):
                pipe = client.pipeline(transaction=False)
                for _ in range(min(_BATCH, beats - start)):
                    node = nodes[rng.randrange(n)]
                    args = _args("keep_alive", node, rules, ttl, keys.channel, key)
                    pipe.evalsha(sha, nkeys, *keys.rendezvous, *args)
                sample = pipe.execute()[-1]
            cpu = cpu_seconds(server.process.pid) - cpu0
            wall = time.perf_counter() - t0
            calls1, usec1, out1 = _stats(client)
            calls = calls1 - calls0
            result[path] = {
                "script_us_per_call": (usec1 - usec0) / calls,
                "server_cpu_us_per_beat": cpu / beats * 1e6,
                "bytes_per_beat": (out1 - out0) / beats,  # two INFO replies included
                "reply_sample": sample.decode()[:80],
                "beats_per_core_second": beats / cpu if cpu else None,
                "wall_s": wall,
            }
        client.close()
        return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--beats", type=int, default=40_000)
    parser.add_argument("--json", type=Path, help="save the results here")
    args = parser.parse_args(argv)
    load = Path("/proc/loadavg").read_text().split()[:3]
    results = {"load_average_before": load, "cases": [measure(n, args.beats) for n in args.nodes]}
    for case in results["cases"]:
        print(f"N={case['n']}: Redis memory {case['memory_per_node']:.0f} B/node")
        for path in ("whole", "short"):
            r = case[path]
            print(
                f"  {path:>5} path: script {r['script_us_per_call']:.1f} us/call, "
                f"redis-server CPU {r['server_cpu_us_per_beat']:.1f} us/beat, "
                f"{r['bytes_per_beat']:.0f} B/beat, one core: "
                f"{r['beats_per_core_second']:,.0f} beats/s; reply {r['reply_sample']!r}"
            )
    print(f"load average before: {' '.join(load)}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
