"""etcd failover: what a SIGKILLed leader of a 3-member cluster costs a job.

A 3-member etcd cluster on loopback (``tests/_etcd_server.py``: heartbeat 50 ms, election
500 ms), and N nodes (handlers with their own connections, in this process) naming every
member. Each trial measures, from the SIGKILL of the leader:

* **store back**: until a store write through a node succeeds again (etcd elected another
  leader and the node's client moved to a live member);
* **members kept**: whether the formed round kept every member through the failover (no
  ``watch()`` of a member returned: nobody was dropped, no re-formation);
* **formation**: with the leader killed while N fresh nodes are joining, until every node
  has its rank.

Then the killed member is started again (it rejoins as a follower) for the next trial.

Run: ``python benchmarks/etcd_ha.py [--nodes 16] [--trials 5] [--json out.json]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aelastic import RendezvousParameters
from aelastic.rendezvous import DynamicRendezvousHandler, create_handler
from tests._etcd_server import EtcdCluster

CONFIG = {
    "join_timeout": 120,
    "last_call_timeout": 30,
    "keep_alive_interval": 0.5,
    "keep_alive_max_attempt": 4,
    "read_timeout": 30,
    "share_connections": 0,
}


def _handlers(endpoint: str, n: int) -> list[DynamicRendezvousHandler]:
    run_id = f"ha-{uuid.uuid4().hex[:8]}"
    params = RendezvousParameters("etcd", endpoint, run_id, n, n, local_addr="127.0.0.1", **CONFIG)
    return [create_handler(params) for _ in range(n)]


async def _trial(cluster: EtcdCluster, n: int) -> dict[str, Any]:
    handlers = _handlers(cluster.endpoint, n)
    try:
        infos = await asyncio.gather(*(h.next_rendezvous() for h in handlers))
        watchers = [asyncio.ensure_future(h.watch()) for h in handlers]
        leader = await asyncio.to_thread(cluster.leader)
        killed = time.monotonic()
        leader.kill()
        while True:
            try:
                await infos[0].store.set("after", "kill")
                break
            except Exception:
                await asyncio.sleep(0.01)
        store_back = time.monotonic() - killed
        await asyncio.sleep(3.0)  # > the heartbeat window: a dropped member would show
        kept = not any(w.done() for w in watchers)
        for w in watchers:
            w.cancel()
    finally:
        await asyncio.gather(*(h.aclose() for h in handlers), return_exceptions=True)
    await asyncio.to_thread(leader.start)
    fresh = _handlers(cluster.endpoint, n)
    try:
        leader = await asyncio.to_thread(cluster.leader)
        started = time.monotonic()
        joining = asyncio.gather(*(h.next_rendezvous() for h in fresh))
        await asyncio.sleep(0.02)
        leader.kill()
        await joining
        formation = time.monotonic() - started
    finally:
        await asyncio.gather(*(h.aclose() for h in fresh), return_exceptions=True)
    await asyncio.to_thread(leader.start)
    return {"store_back_s": store_back, "members_kept": kept, "formation_s": formation}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    trials = []
    with EtcdCluster(3) as cluster:
        for i in range(args.trials):
            trial = await _trial(cluster, args.nodes)
            trials.append(trial)
            print(
                f"trial {i + 1}: store back {trial['store_back_s']:.2f} s, members kept: "
                f"{trial['members_kept']}, formation through a kill {trial['formation_s']:.2f} s",
                flush=True,
            )
    return {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "python": platform.python_version(),
        "nodes": args.nodes,
        "config": CONFIG,
        "etcd": "3 members, heartbeat 50 ms, election 500 ms",
        "trials": trials,
        "median_store_back_s": statistics.median(t["store_back_s"] for t in trials),
        "median_formation_s": statistics.median(t["formation_s"] for t in trials),
        "members_kept": sum(t["members_kept"] for t in trials),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = asyncio.run(run(args))
    print(
        f"median: store back {results['median_store_back_s']:.2f} s, formation through a kill "
        f"{results['median_formation_s']:.2f} s; members kept in "
        f"{results['members_kept']}/{len(results['trials'])} trials"
    )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"results: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
