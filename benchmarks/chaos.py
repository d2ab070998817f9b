"""Chaos: re-form time after random faults, over a real Redis and a real ``aelastic serve``.

Real ``aelastic run`` agents (one sleeping worker each, ``--nnodes 1:MAX``) share a
rendezvous; faults come one at a time (SIGKILL an agent, SIGSTOP then SIGCONT one, SIGKILL a
worker, two kills at once, a new agent; see ``tests/chaos/_faults.py``). After each fault
the run waits until every live agent, and only those, is in one complete round (in the
backend's state, then with its workers of that round running), records both times, pauses
0.2-1 s and injects the next. The report gives their distribution (min / median / p90 /
max) per backend and per kind of fault, how many exceeded the bound the design promises
(heartbeat window + last call + 2 s; an added agent is timed from its first event, after its
interpreter started), and the checks of the chaos test: no duplicate rank in any sample
or round, no agent that ended by itself, nothing of the run left once the agents are gone.
Meanwhile a client that is not a member sends forged requests at random moments (forged
windows; leaves, keep-alives, joins, failure reports, quarantines and "done" naming members;
a stranger's reports and "done"; phantom joins; and the control keys an older aelastic read
from the members' store: a quarantining health record, rank assignments and a master
address for the next rounds, the exit barrier's "all done"; see
``tests/chaos/_forgery.py``): none may change the run.

Run: ``python benchmarks/chaos.py [--backends redis,http] [--agents 5] [--faults 50]
[--seed N] [--json PATH]``
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._servers import server_endpoint
from tests.chaos._cluster import ChaosConfig, Cluster
from tests.chaos._faults import KINDS, Chaos, wait_formed
from tests.chaos._forgery import FORGED_KINDS, Forger

#: Longest wait for a re-form before the fault counts as never re-formed.
_GIVE_UP = 60.0


def quantiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    if not ordered:
        return {}
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return {
        "min": ordered[0],
        "median": statistics.median(ordered),
        "p90": p90,
        "max": ordered[-1],
    }


def run_backend(backend: str, agents: int, faults: int, seed: int) -> dict[str, Any]:
    """One chaos run on ``backend``; its figures and checks."""
    rng = random.Random(seed)
    records: list[dict[str, Any]] = []
    with server_endpoint(backend) as endpoint, tempfile.TemporaryDirectory() as tmp:
        config = ChaosConfig(backend, endpoint, f"chaos-{uuid.uuid4().hex[:8]}", agents=agents)
        cluster = Cluster(config, Path(tmp))
        try:
            started = time.monotonic()
            for _ in range(agents):
                cluster.start_agent()
            cluster.start_sampling()
            first = wait_formed(cluster, started, _GIVE_UP)
            if first.workers is None:
                raise RuntimeError(f"{backend}: the first round never formed")
            chaos = Chaos(cluster, rng)
            forger = Forger(config, rng)
            forger.start()
            for n in range(faults):
                time.sleep(rng.uniform(0.2, 1.0))
                fault = chaos.inject()
                reform = wait_formed(cluster, fault.at, _GIVE_UP)
                records.append({"kind": fault.kind, "detail": fault.detail, **reform.__dict__})
                print(
                    f"  {backend} {n + 1:3d}/{faults} {fault.kind:<11} "
                    f"state {_fmt(reform.state)} workers {_fmt(reform.workers)}  {fault.detail}",
                    flush=True,
                )
            forger.stop()
            cluster.stop_all()
            left = cluster.wait_no_leftovers(config.grace + 10)
            checks = {
                "forgery": forger.summary(),
                "sample_violations": cluster.violations,
                "round_violations": cluster.history_violations(),
                "unexpected_exits": cluster.unexpected_exits(),
                "leftovers": left,
                "samples": cluster.samples,
            }
        finally:
            cluster.close()
    return summarize(backend, seed, config, records, checks)


def _fmt(value: float | None) -> str:
    return "never" if value is None else f"{value:6.2f} s"


def summarize(
    backend: str,
    seed: int,
    config: ChaosConfig,
    records: list[dict[str, Any]],
    checks: dict[str, Any],
) -> dict[str, Any]:
    bound = config.reform_bound
    by_kind: dict[str, list[float]] = defaultdict(list)
    for r in records:
        if r["workers"] is not None:
            by_kind[r["kind"]].append(r["workers"])
    return {
        "backend": backend,
        "seed": seed,
        "faults": len(records),
        "bound": bound,
        "state": quantiles([r["state"] for r in records if r["state"] is not None]),
        "workers": quantiles([r["workers"] for r in records if r["workers"] is not None]),
        "over_bound": sum(1 for r in records if r["state"] is None or r["state"] > bound),
        "never": sum(1 for r in records if r["workers"] is None),
        "by_kind": {k: quantiles(v) | {"n": len(v)} for k, v in sorted(by_kind.items())},
        "checks": checks,
        "records": records,
    }


def report(result: dict[str, Any]) -> None:
    def row(name: str, q: dict[str, float]) -> str:
        if not q:
            return f"  {name:<26} -"
        cells = " ".join(f"{q[k]:6.2f}" for k in ("min", "median", "p90", "max"))
        return f"  {name:<26} {cells}"

    print(
        f"\n{result['backend']}: {result['faults']} faults, seed {result['seed']}, "
        f"bound {result['bound']:.1f} s"
    )
    print(f"  {'re-form (s)':<26} {'min':>6} {'median':>6} {'p90':>6} {'max':>6}")
    print(row("state: one round", result["state"]))
    print(row("workers running", result["workers"]))
    for kind in KINDS:
        if kind in result["by_kind"]:
            q = result["by_kind"][kind]
            print(row(f"  {kind} (n={q['n']})", q))
    checks = result["checks"]
    print(
        f"  over the bound: {result['over_bound']}, never re-formed: {result['never']}, "
        f"samples: {checks['samples']}, duplicate or gapped ranks: "
        f"{len(checks['sample_violations']) + len(checks['round_violations'])}, "
        f"agents ended by themselves: {len(checks['unexpected_exits'])}, "
        f"processes left: {len(checks['leftovers'])}"
    )
    forgery = checks["forgery"]
    print(
        f"  forged requests from a non-member: {forgery['sent']}, changes they made: "
        f"{len(forgery['changes'])}, nodes the run's own window pruned meanwhile: "
        f"{forgery['pruned_by_the_runs_window']}, names taken after the run dropped their "
        f"node: {forgery['names_taken_after_the_run_dropped_them']}, errors: "
        f"{len(forgery['errors'])}"
    )
    for kind in FORGED_KINDS:
        done = forgery["by_kind"][kind]
        said = ", ".join(f"{o} {n}" for o, n in sorted(done["outcomes"].items()))
        print(f"    {kind:<18} {done['sent']:4d}  {said}")
    for problem in (
        checks["sample_violations"]
        + checks["round_violations"]
        + checks["unexpected_exits"]
        + forgery["changes"]
        + forgery["errors"]
    ):
        print(f"  ! {problem}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default="redis,http")
    p.add_argument("--agents", type=int, default=5)
    p.add_argument("--faults", type=int, default=50)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", default=None, help="write the results (with every fault) here")
    args = p.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    print(f"chaos seed {seed} (replay the same choices with --seed {seed})", flush=True)
    results = []
    for backend in args.backends.split(","):
        results.append(run_backend(backend, args.agents, args.faults, seed))
    for result in results:
        report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    bad = any(
        r["never"]
        or r["checks"]["leftovers"]
        or r["checks"]["round_violations"]
        or r["checks"]["sample_violations"]
        or r["checks"]["unexpected_exits"]
        or r["checks"]["forgery"]["changes"]
        for r in results
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
