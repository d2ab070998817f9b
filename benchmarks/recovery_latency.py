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

The case ``node-loss`` (:mod:`benchmarks._node_loss`): 3 nodes of a ``--nnodes 2:2`` job (a
spare), a real gloo training loop, one member SIGKILLed -> every rank of the re-formed job
finished its next training step: torchrun (c10d, restart from a checkpoint), aelastic
restarting from the checkpoint (warm standbys off), aelastic with a hot spare (standbys with
torch imported), aelastic with a hot spare and in-place recovery. The member killed is the
one of rank 1 (torch's first launcher hosts its rendezvous: never killed); the case
``node-loss-rank0`` kills the member of rank 0, whose address is the workers' master
(aelastic's variants only). Each prints the median and the worst of its runs.

Run: ``python benchmarks/recovery_latency.py [--repeat 5] [--backend http|redis]
[--cases crash,node-loss,node-loss-rank0] [--plot docs/recovery.png]`` (``--plot``: the
medians as bars, torch beside aelastic's variants; needs matplotlib).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _node_loss, _plots
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


NODE_LOSS = {
    "torch": "torchrun (c10d), restart from checkpoint",
    "restart": "aelastic, restart from checkpoint",
    "spare": "aelastic, hot spare",
    "inplace": "aelastic, hot spare + in-place",
}


def node_loss(repeat: int, backend: str = "http", victim: str = "other") -> dict[str, list[float]]:
    """Each variant of the node-loss case, measured in turns: its times in the order run
    (``victim="rank0"``: the member of rank 0 is the one killed; torch is not measured then,
    its first launcher hosting its rendezvous)."""
    variants = [v for v in NODE_LOSS if victim != "rank0" or v != "torch"]
    times: dict[str, list[float]] = {variant: [] for variant in variants}
    loads: list[float] = []
    for _ in range(repeat):
        for variant in variants:
            run_id = f"bench-{uuid.uuid4().hex[:8]}"
            if variant == "torch":
                seconds = _node_loss.measure(variant, f"{LOOPBACK}:{free_port()}", run_id)
            else:
                with server_endpoint(backend) as endpoint:
                    seconds = _node_loss.measure(variant, endpoint, run_id, victim=victim)
            times[variant].append(seconds)
            load = os.getloadavg()[0]
            loads.append(load)
            print(
                f"  node loss ({_VICTIMS[victim]}), {NODE_LOSS[variant]}: {seconds:.3f} s "
                f"(load {load:.1f})",
                file=sys.stderr,
            )
    print(
        f"load average (1 min) at each measurement: median {median(loads):.1f}, "
        f"{min(loads):.1f} to {max(loads):.1f} (2 cores)"
    )
    return times


_VICTIMS = {"other": "the member of rank 1 killed", "rank0": "the member of rank 0 killed"}


def _worst_cases(title: str, times: dict[str, list[float]]) -> str:
    """Median and worst of each variant."""
    lines = [title, f"{'variant':<44} {'median':>8} {'worst':>8}  runs"]
    for variant, values in times.items():
        runs = ", ".join(f"{v:.2f}" for v in values)
        lines.append(
            f"{NODE_LOSS[variant]:<44} {median(values):>7.3f}s {max(values):>7.3f}s  {runs}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs per case (median)")
    parser.add_argument("--backend", choices=("http", "redis"), default="http")
    parser.add_argument("--plot", type=Path, help="write the medians as a PNG bar chart here")
    parser.add_argument(
        "--cases", default="crash,node-loss", help="crash, node-loss, node-loss-rank0 (a list)"
    )
    args = parser.parse_args(argv)
    cases = set(args.cases.split(","))
    panels = []
    title = f"Recovery latency, median of {args.repeat} (lower is better)"
    if "node-loss-rank0" in cases:
        worst = node_loss(args.repeat, args.backend, victim="rank0")
        print(_worst_cases(f"{title}: {_VICTIMS['rank0']} -> every rank's next step", worst))
    if "node-loss" in cases:
        runs = node_loss(args.repeat, args.backend)
        print(_worst_cases(f"{title}: {_VICTIMS['other']} -> every rank's next step", runs))
        loss = {variant: median(values) for variant, values in runs.items()}
        rows = [(f"node lost: {v}", loss["torch"], loss[v], "s") for v in NODE_LOSS]
        print(table(f"{title}: node lost -> every rank finished its next step", rows[1:]))
        bound = _node_loss.AFTER_KILL
        if loss["torch"] == math.inf:
            print(f"torchrun: no step within {bound:g} s of the kill (plotted at {bound:g} s)")
        series = {
            NODE_LOSS[v] + (f": no step in {bound:g} s" if loss[v] == math.inf else ""): [
                min(loss[v], bound)
            ]
            for v in NODE_LOSS
        }
        group = ["3 nodes, --nnodes 2:2\n(one a spare; gloo, CPU)"]
        panels.append(("a node is lost -> every rank's next step", "seconds", group, series))
    if "crash" in cases:
        panels.insert(0, crashes(args))
    if args.plot is not None:
        _plots.bars(
            panels,
            args.plot,
            title=title,
            note=_plots.footnote("torch and aelastic measured in the same run"),
            log=True,
        )
        print(f"wrote {args.plot}")
    return 0


def crashes(args: argparse.Namespace) -> tuple[str, str, list[str], dict[str, list[float]]]:
    """The worker-crash cases (printed); their plot panel."""
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
    groups = [
        "1 node x 2 workers\n(standalone)",
        f"2 nodes x 1 worker\n(c10d / {args.backend})",
    ]
    series = {
        "torchrun": [rows[0][1], rows[2][1]],
        "aelastic": [rows[0][2], rows[2][2]],
        "aelastic, warm standby off": [rows[1][2], rows[3][2]],
    }
    return ("a worker crashes -> next attempt runs", "seconds (log scale)", groups, series)


if __name__ == "__main__":
    sys.exit(main())
