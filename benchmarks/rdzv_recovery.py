"""Recovery at scale: a node of an N-node job is lost -> every survivor has its new round.

Every simulated node is a handler with its own connections (``share_connections=0``) plus
a stand-in worker whose "collective" is a socket to a peer (``_recovery_node.py``), and
reacts as aelastic's agent does: a group change calls for a re-rendezvous (the policy's
``decide``), a broken collective has the backend report the departures and waits for the
change that explains it (``RoundGroup.loss_within``), then the stand-in worker is stopped
(its sockets close) and ``next_rendezvous()`` is called. The nodes run in ``--procs``
processes, plus one process holding a single node, the victim. The benchmark starts its
own server on free loopback ports (``_scale_servers``: ``redis-server``, ``etcd``, aelastic's
HTTP server app with counters), fresh for each job.

The job is ``--nnodes (N-1):N`` (``min_nodes=N-1``, ``max_nodes=N``) with a short last call
(``--last-call``). Cases, each a fresh job of N nodes:

* ``kill``: SIGKILL of the victim's process (its sockets close at once), the victim the node
  of the highest rank;
* ``kill-rank0``: the same, the victim the node of rank 0, whose address and port are the
  master's (the survivors' new master is another node's);
* ``stop``: SIGSTOP of the victim (a host that died: nothing closes, only its silence tells;
  the target is the heartbeat window + 0.5 s).

``--breaks all`` (the default, the worst case): every stand-in worker also holds a socket to
the victim's, so every survivor's collective breaks at the kill and all of them report
departures at the same moment; ``--breaks ring``: only those of the victim's two neighbours
break at the kill (each rank connects to the next), the others as their peers' workers are
stopped.

Measured per case: seconds from the signal until every survivor's ``next_rendezvous()``
returned the new round (max, median) and until each reacted; the new round checked (one
round of all N-1 survivors, every rank once, the same master for all: rank 0's address and
port); the server's requests, bytes and CPU from the signal to the last survivor's new round
per survivor, as counted and net of the idle heartbeats over the same time.

Run: ``python benchmarks/rdzv_recovery.py --backends http --sizes 64,1024 --json out.json``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._recovery_case import measure
from benchmarks._recovery_report import format_report, save
from benchmarks._scale_node import raise_fd_limit
from benchmarks._scale_servers import (
    ROOT,
    EtcdUnderTest,
    HttpUnderTest,
    RedisUnderTest,
    ServerUnderTest,
)

SERVERS: dict[str, Callable[[], ServerUnderTest]] = {
    "redis": RedisUnderTest,
    "http": HttpUnderTest,
    "etcd": EtcdUnderTest,
}
CASES = ("kill", "kill-rank0", "stop")
#: The nodes' addresses (torch's rank order sorts nodes by address first): the survivors
#: share one; the victim sorts before them (rank 0) or after them (the highest rank).
SURVIVORS_ADDR, FIRST_ADDR, LAST_ADDR = "127.0.0.2", "127.0.0.1", "127.0.0.3"
#: Outcomes before the loss (the job never was stable to measure): the job is run again.
_RETRIED = ("did not start", "did not form", "unstable")


def _split(nodes: int, procs: int) -> list[int]:
    """``nodes`` spread as evenly as possible over at most ``procs`` processes."""
    procs = max(1, min(procs, nodes))
    return [nodes // procs + (i < nodes % procs) for i in range(procs)]


def _config(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "join_timeout": 600,
        "last_call_timeout": args.last_call,
        "keep_alive_interval": args.keep_alive,
        "keep_alive_max_attempt": args.max_attempts,
        "read_timeout": 120,
        "share_connections": 0,
    }


def node_command(
    spec: dict[str, Any], endpoints: list[str], processes: int, victim_addr: str
) -> Callable[[int, int], list[str]]:
    """The command line of node process ``index`` (the last one holds the victim)."""

    def command(index: int, count: int) -> list[str]:
        addr = victim_addr if index == processes - 1 else SURVIVORS_ADDR
        local = {**spec, "endpoint": endpoints[index % len(endpoints)], "count": count}
        local["local_addr"] = addr
        return [sys.executable, "-m", "benchmarks._recovery_node", json.dumps(local)]

    return command


async def run_case(
    backend: str, n: int, case: str, args: argparse.Namespace, log_dir: Path
) -> dict[str, Any]:
    server = SERVERS[backend]()
    counts = [*_split(n - 1, args.procs), 1]
    try:
        spec = {
            "backend": backend,
            "run_id": f"recovery-{uuid.uuid4().hex[:8]}",
            "min_nodes": n - 1,
            "max_nodes": n,
            "loop": args.node_loop,
            "config": _config(args),
            "log_level": args.node_log_level,
        }
        victim_addr = FIRST_ADDR if case == "kill-rank0" else LAST_ADDR
        result = await measure(
            server,
            counts,
            node_command(spec, server.endpoints, len(counts), victim_addr),
            how="stop" if case == "stop" else "kill",
            log_dir=log_dir,
            name=f"{backend}-{n}-{case}",
            breaks=args.breaks,
            timeout=args.timeout,
            settle=args.settle,
            idle=args.idle,
            recovery_timeout=args.recovery_timeout,
        )
    finally:
        server.close()
    return {"backend": backend, "case": case, **result}


def _progress(case: dict[str, Any]) -> None:
    took = case.get("recovery", {}).get("max_s")
    text = "" if took is None else f": every survivor's new round in {took:.3f} s"
    load = case.get("load_average_at_loss", case["load_average_before"])[0]
    print(
        f"  {case['backend']} N={case['n']} {case['case']}: {case['status']}{text} "
        f"(load {load:.1f})",
        file=sys.stderr,
        flush=True,
    )


def _commit() -> str | None:
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        )
        return out.stdout.strip()
    return None


async def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {
        "label": args.label,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": _commit(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_average_at_start": os.getloadavg(),
        "settings": {
            "sizes": args.sizes,
            "procs": args.procs,
            "cases": args.cases,
            "breaks": args.breaks,
            "repeat": args.repeat,
            "config": _config(args),
        },
        "cases": [],
    }
    log_dir = Path(tempfile.mkdtemp(prefix="aelastic-recovery-"))
    for backend in args.backends:
        for n in args.sizes:
            for case in args.cases:
                for _ in range(args.repeat):
                    for attempt in range(1 + args.retries):
                        result = await run_case(backend, n, case, args, log_dir)
                        result["attempt"] = attempt + 1
                        _progress(result)
                        if result["status"] not in _RETRIED:
                            break
                    results["cases"].append(result)
    issues = sum(c.get("log_issues", {}).get("lines", 0) for c in results["cases"])
    if issues or args.node_log_level != "WARNING":
        print(f"node logs (with {issues} error/warning lines): {log_dir}", file=sys.stderr)
    else:
        shutil.rmtree(log_dir, ignore_errors=True)
    return results


def _list(text: str) -> list[str]:
    return [s for s in text.split(",") if s]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=lambda t: [int(s) for s in _list(t)], default=[64, 1024])
    parser.add_argument("--backends", type=_list, default=["http"], help="comma-separated")
    parser.add_argument("--cases", type=_list, default=list(CASES), help="comma-separated")
    parser.add_argument("--breaks", choices=("all", "ring"), default="all")
    parser.add_argument("--procs", type=int, default=4, help="node processes (+1: the victim)")
    parser.add_argument("--repeat", type=int, default=1, help="jobs per backend, N and case")
    parser.add_argument(
        "--retries", type=int, default=2, help="new jobs for one that was not stable to measure"
    )
    parser.add_argument("--node-loop", choices=("asyncio", "uvloop"), default="asyncio")
    parser.add_argument(
        "--node-log-level", default="WARNING", help="of the nodes' logs (kept if not empty)"
    )
    parser.add_argument("--keep-alive", type=float, default=1.0, help="keep_alive_interval (s)")
    parser.add_argument("--max-attempts", type=int, default=3, help="keep_alive_max_attempt")
    parser.add_argument("--last-call", type=float, default=0.2, help="last_call_timeout (s)")
    parser.add_argument("--settle", type=float, default=2.0, help="pause after wiring (s)")
    parser.add_argument("--idle", type=float, default=3.0, help="idle baseline window (s)")
    parser.add_argument("--timeout", type=float, default=300.0, help="formation limit (s)")
    parser.add_argument("--recovery-timeout", type=float, default=60.0, help="recovery limit")
    parser.add_argument("--label", default="run", help="what was measured")
    parser.add_argument("--json", type=Path, help="save the results here")
    args = parser.parse_args(argv)
    unknown = set(args.backends) - set(SERVERS)
    if unknown:
        parser.error(f"unknown backends: {', '.join(sorted(unknown))}")
    if set(args.cases) - set(CASES):
        parser.error(f"cases are among {', '.join(CASES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    raise_fd_limit()
    results = asyncio.run(run(args))
    print(format_report(results))
    if args.json:
        save(results, args.json)
        print(f"results: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
