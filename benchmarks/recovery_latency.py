"""Recovery latency: a worker crashes -> every worker of the next attempt has started.

aelastic's agent and torchrun are measured in the same run, side by side:

* 1 node x 2 workers: aelastic (embedded memory rendezvous) against ``torchrun --standalone``;
* 2 nodes x 1 worker (two launcher processes on this machine): aelastic over its HTTP (or
  Redis) rendezvous against two torchrun agents on a c10d rendezvous.

Global rank 0 crashes one second after it starts; the time is from its crash to the start
of the last worker of the next attempt (worker clocks: the same machine). Each case is
repeated and the median printed, with the ratio torch / aelastic (higher is better).
aelastic is measured with its warm standbys (the default: the next attempt's interpreters
are started ahead of time) and without them (cold start, like torchrun).

Run: ``python benchmarks/recovery_latency.py [--repeat 5] [--backend http|redis]
[--plot docs/recovery.png]`` (``--plot``: the medians as bars, torch beside aelastic with and
without warm standbys; needs matplotlib).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _plots
from benchmarks._agent_bench import (
    LOOPBACK,
    Reports,
    aelastic_node_cmd,
    env_for,
    finish,
    launched,
    median,
    table,
    torchrun_cmd,
)
from benchmarks._servers import server_endpoint
from tests._http_server import free_port

Commands = Callable[[str], list[list[str]]]


def measure(commands: Sequence[list[str]], workers: int, warm: bool) -> float:
    """Seconds from the crash to the last start of the next attempt."""
    reports = Reports()
    with tempfile.TemporaryDirectory(prefix="aelastic-bench-") as tmp:
        marker = str(Path(tmp) / "crashed")
        env = env_for(
            reports, BENCH_MARK=marker, BENCH_CRASH_AFTER="1.0", BENCH_WARM=str(int(warm))
        )
        try:
            with launched(commands, env) as procs:
                deadline = time.monotonic() + 120
                crash: float | None = None
                starts: dict[int, float] = {}
                while crash is None or len(starts) < workers:
                    words = reports.next(deadline)
                    if words[0] == "crash":
                        crash = float(words[1])
                    elif words[0] == "start" and words[1] == "1":
                        starts.setdefault(int(words[2]), float(words[3]))
                finish(procs)
        finally:
            reports.close()
    return max(starts.values()) - crash


def torch_1x2(run_id: str) -> list[list[str]]:
    args = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1"]
    return [torchrun_cmd(args, "crash")]


def aelastic_1x2(run_id: str) -> list[list[str]]:
    return [aelastic_node_cmd("memory", "local", run_id, 1, 2, 1, "crash")]


def torch_2x1(run_id: str) -> list[list[str]]:
    endpoint = f"{LOOPBACK}:{free_port()}"
    args = ["--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "1"]
    args += ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id]
    args += ["--local-addr", LOOPBACK]
    return [torchrun_cmd(args, "crash") for _ in range(2)]


def run_case(commands: Commands, workers: int, repeat: int, name: str, warm: bool = True) -> float:
    times = []
    for _ in range(repeat):
        times.append(measure(commands(f"bench-{uuid.uuid4().hex[:8]}"), workers, warm))
        print(f"  {name}: {times[-1]:.3f} s", file=sys.stderr)
    return median(times)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs per case (median)")
    parser.add_argument("--backend", choices=("http", "redis"), default="http")
    parser.add_argument("--plot", type=Path, help="write the medians as a PNG bar chart here")
    args = parser.parse_args(argv)

    rows = []
    t = run_case(torch_1x2, 2, args.repeat, "torch 1x2")
    a = run_case(aelastic_1x2, 2, args.repeat, "aelastic 1x2")
    cold = run_case(aelastic_1x2, 2, args.repeat, "aelastic 1x2 cold", warm=False)
    rows.append(("1 node x 2 workers (standalone)", t, a, "s"))
    rows.append(("  same, warm standby off", t, cold, "s"))

    with server_endpoint(args.backend) as endpoint:

        def aelastic_2x1(run_id: str) -> list[list[str]]:
            return [
                aelastic_node_cmd(args.backend, endpoint, run_id, 2, 1, 1, "crash")
                for _ in range(2)
            ]

        t = run_case(torch_2x1, 2, args.repeat, "torch 2x1")
        a = run_case(aelastic_2x1, 2, args.repeat, "aelastic 2x1")
        cold = run_case(aelastic_2x1, 2, args.repeat, "aelastic 2x1 cold", warm=False)
    rows.append((f"2 nodes x 1 worker (c10d / {args.backend})", t, a, "s"))
    rows.append(("  same, warm standby off", t, cold, "s"))
    print(table(f"Recovery latency, median of {args.repeat} (lower is better)", rows))
    if args.plot is not None:
        groups = [
            "1 node x 2 workers\n(standalone)",
            f"2 nodes x 1 worker\n(c10d / {args.backend})",
        ]
        series = {
            "torchrun": [rows[0][1], rows[2][1]],
            "aelastic": [rows[0][2], rows[2][2]],
            "aelastic, warm standby off": [rows[1][2], rows[3][2]],
        }
        _plots.bars(
            [("a worker crashes -> next attempt runs", "seconds (log scale)", groups, series)],
            args.plot,
            title=f"Recovery latency, median of {args.repeat} (lower is better)",
            note=_plots.footnote("torch and aelastic measured in the same run"),
            log=True,
        )
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
