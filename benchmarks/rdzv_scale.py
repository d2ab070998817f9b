"""Rendezvous at scale: what formation, idling and failure detection cost the server, per node.

Every simulated node is a handler with its own connections that does its own reads (nothing
shared between nodes of one process), so the server sees what N real nodes would send it.
The nodes run in a few worker processes (``--procs``), plus one more process holding a
single node, the one killed in the last phase. The benchmark starts its own servers on free
loopback ports: ``redis-server``, ``etcd``, and aelastic's HTTP server app (as ``aelastic serve``
runs it) with a counting middleware; both fresh for each N.

For each backend and N (min = max = N, ``keep_alive_interval=1``, large join and last-call
timeouts, ``share_connections=0``):

* formation: wall time until every node's ``next_rendezvous()`` returned; server commands and
  bytes out per node (Redis: ``INFO stats``; HTTP: requests and answer bytes);
* idle (``--idle`` s, every node heartbeating and in ``watch()``): commands, bytes out and
  wake-ups per node per second; any ``watch()`` return is a spurious membership change;
* kill detection: SIGKILL of the one-node process; max and median over the survivors of the
  time until their ``watch()`` showed that node lost.

Also: torch's own ``DynamicRendezvousHandler`` + ``C10dRendezvousBackend`` (each node its own
``TCPStore`` client, nodes as threads; bytes counted by a proxy in front of the store) at
``--torch-sizes``; and a spurious-change check, ``--spurious-procs`` processes of one node
each idling ``--spurious-idle`` s (any ``watch()`` return is reported; there must be none).

Isolation: ``loop`` runs a process's nodes as tasks of one event loop (the backend must honour
``share_connections=0``); ``thread`` gives each node its own event loop in its own thread
(for code that shares connections per loop); ``auto`` (default) measures whether handlers of
one loop share connections and picks.

Run: ``python benchmarks/rdzv_scale.py --quick --label before --json benchmarks/results/x.json``
``python benchmarks/rdzv_scale.py --plot-from a.json b.json --plot scale.png`` (plot only)
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

from benchmarks._scale_case import busy_loops, measure, node_command, torch_command
from benchmarks._scale_node import raise_fd_limit
from benchmarks._scale_report import format_report, plot, save
from benchmarks._scale_servers import (
    ROOT,
    EtcdUnderTest,
    HttpUnderTest,
    RedisUnderTest,
    ServerUnderTest,
    TorchStoreUnderTest,
)

CONFIG = {
    "join_timeout": 3600,
    "last_call_timeout": 600,
    "keep_alive_interval": 1,
    "read_timeout": 120,
    "share_connections": 0,
}
TORCH_CONFIG = {k: v for k, v in CONFIG.items() if k != "share_connections"}
SERVERS: dict[str, Callable[[], ServerUnderTest]] = {
    "redis": RedisUnderTest,
    "http": HttpUnderTest,
    "etcd": EtcdUnderTest,
}


def _split(nodes: int, procs: int) -> list[int]:
    """``nodes`` spread as evenly as possible over at most ``procs`` processes."""
    procs = max(1, min(procs, nodes))
    return [nodes // procs + (i < nodes % procs) for i in range(procs)]


def _run_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


async def shares_connections() -> bool:
    """Whether handlers of one event loop share connections despite ``share_connections=0``.

    Measured on a fresh ``redis-server``: connections opened for one handler's read, then
    for two more handlers reading at once on the same loop. Sharing opens fewer than twice.
    """
    from aelastic import RendezvousParameters
    from aelastic.rendezvous import create_handler

    server = RedisUnderTest()
    handlers: list[Any] = []
    try:
        run_id = _run_id("probe")

        async def read(count: int) -> int:
            start = server.snapshot().connections
            made = [
                create_handler(
                    RendezvousParameters(
                        "redis", server.endpoint, run_id, 4, 4, local_addr="127.0.0.1", **CONFIG
                    )
                )
                for _ in range(count)
            ]
            handlers.extend(made)
            await asyncio.gather(*(h.num_nodes_waiting() for h in made))
            await asyncio.sleep(0.5)  # background connections (pub/sub) settle
            return server.snapshot().connections - start

        one = await read(1)
        two = await read(2)
        return one == 0 or two < 2 * one
    finally:
        for handler in handlers:
            with contextlib.suppress(Exception):
                await handler.aclose()
        server.close()


async def run_aelastic(
    backend: str,
    counts: list[int],
    args: argparse.Namespace,
    isolation: str,
    log_dir: Path,
    *,
    idle: float,
    kill: bool,
    name: str,
) -> dict[str, Any]:
    server = SERVERS[backend]()
    try:
        spec = {
            "backend": backend,
            "endpoint": server.endpoint,
            "run_id": _run_id("scale"),
            "nodes": sum(counts),
            "isolation": isolation,
            "loop": args.node_loop,
            "config": CONFIG,
        }
        result = await measure(
            server,
            counts,
            node_command(spec, server.endpoints),
            log_dir=log_dir,
            name=name,
            timeout=args.timeout,
            settle=args.settle,
            idle=idle,
            kill=kill,
            detect_timeout=args.detect_timeout,
        )
    finally:
        server.close()
    return {"backend": backend, "isolation": isolation, "node_loop": args.node_loop, **result}


async def run_torch(n: int, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    server = TorchStoreUnderTest()
    try:
        spec = {"endpoint": server.endpoint, "run_id": _run_id("torch"), "nodes": n}
        spec["config"] = TORCH_CONFIG
        result = await measure(
            server,
            [n],
            torch_command(spec),
            log_dir=log_dir,
            name=f"torch-{n}",
            timeout=args.timeout,
            settle=0.0,
            idle=0.0,
            kill=False,
            detect_timeout=0.0,
        )
    finally:
        server.close()
    return {"backend": "torch-c10d", **result}


def _progress(case: dict[str, Any]) -> None:
    formation = case.get("formation", {})
    seconds = formation.get("seconds")
    took = "" if seconds is None else f" in {seconds:.3f} s"
    print(f"  {case['backend']} N={case['n']}: {case['status']}{took}", file=sys.stderr, flush=True)


def _commit() -> str | None:
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        )
        return out.stdout.strip()
    return None


async def run(args: argparse.Namespace) -> dict[str, Any]:
    isolation = args.isolation
    if isolation == "auto":
        isolation = "thread" if await shares_connections() else "loop"
        print(f"isolation: {isolation} (measured)", file=sys.stderr, flush=True)
    results: dict[str, Any] = {
        "label": args.label,
        "isolation": isolation,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": _commit(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_average_at_start": os.getloadavg(),
        "settings": {
            "sizes": args.sizes,
            "procs": args.procs,
            "idle_s": args.idle,
            "timeout_s": args.timeout,
            "config": CONFIG,
            "busy_loops": args.busy,
        },
        "cases": [],
        "torch": [],
        "spurious": [],
    }
    log_dir = Path(tempfile.mkdtemp(prefix="aelastic-scale-"))
    for backend in args.backends:
        stopped_at = None
        for n in args.sizes:
            if stopped_at is not None:  # a larger N would not finish either
                skipped = f"skipped (N={stopped_at} did not finish)"
                results["cases"].append({"backend": backend, "n": n, "status": skipped})
                continue
            counts = [*_split(n - 1, args.procs), 1]
            case = await run_aelastic(
                backend,
                counts,
                args,
                isolation,
                log_dir,
                idle=args.idle,
                kill=True,
                name=f"{backend}-{n}",
            )
            results["cases"].append(case)
            _progress(case)
            if case["status"] != "ok":
                stopped_at = n
    stopped_at = None
    for n in args.torch_sizes:
        if stopped_at is not None:
            skipped = f"skipped (N={stopped_at} did not finish)"
            results["torch"].append({"backend": "torch-c10d", "n": n, "status": skipped})
            continue
        case = await run_torch(n, args, log_dir)
        results["torch"].append(case)
        _progress(case)
        if case["status"] != "ok":
            stopped_at = n
    if args.spurious_procs > 0:
        for backend in args.backends:
            case = await run_aelastic(
                backend,
                [1] * args.spurious_procs,
                args,
                isolation,
                log_dir,
                idle=args.spurious_idle,
                kill=False,
                name=f"spurious-{backend}",
            )
            results["spurious"].append(case)
            _progress(case)
    issues = sum(
        c.get("log_issues", {}).get("lines", 0)
        for group in ("cases", "torch", "spurious")
        for c in results[group]
    )
    if issues:
        print(f"worker logs (with {issues} error/warning lines): {log_dir}", file=sys.stderr)
    else:
        shutil.rmtree(log_dir, ignore_errors=True)
    return results


def _sizes(text: str) -> list[int]:
    return [int(s) for s in text.split(",") if s]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=_sizes, default=[64, 256, 1024, 4096], help="N values")
    parser.add_argument("--backends", default="redis,http", help="comma-separated")
    parser.add_argument("--procs", type=int, default=4, help="worker processes (+1 for the kill)")
    parser.add_argument("--isolation", choices=("auto", "loop", "thread"), default="auto")
    parser.add_argument(
        "--node-loop",
        choices=("asyncio", "uvloop"),
        default="asyncio",
        help="event loop of the simulated nodes' processes (uvloop: less of the shared CPU)",
    )
    parser.add_argument("--idle", type=float, default=30.0, help="idle window (s)")
    parser.add_argument("--settle", type=float, default=2.0, help="pause before the idle window")
    parser.add_argument(
        "--keep-alive", type=float, default=1.0, help="keep_alive_interval of every node (s)"
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="formation limit (s) per N")
    parser.add_argument("--detect-timeout", type=float, default=60.0, help="kill detection limit")
    parser.add_argument("--torch-sizes", type=_sizes, default=[64, 256], help="'' for none")
    parser.add_argument("--spurious-procs", type=int, default=128, help="0 to skip the check")
    parser.add_argument("--spurious-idle", type=float, default=60.0)
    parser.add_argument("--quick", action="store_true", help="N = 64,256, 10 s idle windows")
    parser.add_argument(
        "--busy", type=int, default=0, help="processes spinning on the CPU during the run"
    )
    parser.add_argument("--label", default="run", help="design measured (before, after, ...)")
    parser.add_argument("--json", type=Path, help="save the results here")
    parser.add_argument("--plot", type=Path, help="PNG of per-node formation bytes vs N")
    parser.add_argument(
        "--plot-from", type=Path, nargs="+", help="plot these saved results (no measuring)"
    )
    args = parser.parse_args(argv)
    args.backends = [b for b in args.backends.split(",") if b]
    unknown = set(args.backends) - set(SERVERS)
    if unknown:
        parser.error(f"unknown backends: {', '.join(sorted(unknown))}")
    if args.quick:
        args.sizes, args.idle, args.spurious_idle = [64, 256], 10.0, 10.0
    CONFIG["keep_alive_interval"] = args.keep_alive
    TORCH_CONFIG["keep_alive_interval"] = args.keep_alive
    if args.plot_from and not args.plot:
        parser.error("--plot-from needs --plot PATH.png")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    raise_fd_limit()
    if args.plot_from:
        documents = [json.loads(path.read_text()) for path in args.plot_from]
        plot(documents, args.plot)
        print(f"plot: {args.plot}")
        return 0
    with busy_loops(args.busy):
        results = asyncio.run(run(args))
    print(format_report(results))
    if args.json:
        save(results, args.json)
        print(f"results: {args.json}")
    if args.plot:
        plot([results], args.plot)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
