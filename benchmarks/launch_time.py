"""Launch time and memory: ``aelastic run`` against ``torchrun``, on the same no-op script.

Usage::

    python benchmarks/launch_time.py [--runs 5] [--nproc 1] [--json] [--plot docs/launch.png]

How it works: both launchers run ``--standalone --nproc-per-node N noop.py`` (a script that does
nothing), one after the other, ``--runs`` times each (interleaved, so that the load of a shared
machine hits both alike), after one warm-up run each (so that both start from written bytecode
caches, as an installed package does). For every run it measures:

* wall time from the launcher's start to its exit (end to end: start, rendezvous, spawn the
  worker, wait for it, shut down);
* peak RSS of the largest process of the tree (what ``/usr/bin/time -f %M`` reports: for
  torchrun, its launcher, which imports torch);
* peak RSS of the whole tree (launcher plus workers, summed, sampled every few milliseconds
  from ``/proc``).

It prints the medians and the ratios torchrun / aelastic, and whether the targets hold
(aelastic at least 5x faster, and far lighter); ``--plot`` draws them as a PNG (matplotlib).
Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Runs the launcher given as arguments; reports its wall time (s) and ru_maxrss (KiB) on
#: stderr's last line (the wrapper's own start-up is not in the wall time).
_RUSAGE_WRAPPER = (
    "import resource, subprocess, sys, time\n"
    "started = time.perf_counter()\n"
    "code = subprocess.call(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
    "wall = time.perf_counter() - started\n"
    "print(wall, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)\n"
    "sys.exit(code)\n"
)


@dataclass
class Sample:
    wall: float
    peak_process_kib: int
    peak_tree_kib: int


def _rss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as fp:
            for line in fp:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _tree(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fp:
            children = [int(p) for p in fp.read().split()]
    except OSError:
        return [pid]
    return [pid, *(q for child in children for q in _tree(child))]


def _sample_tree(wrapper: int, stop: threading.Event, peak: list[int]) -> None:
    while not stop.is_set():
        total = sum(_rss_kib(pid) for pid in _tree(wrapper)[1:])  # the wrapper is not counted
        peak[0] = max(peak[0], total)
        stop.wait(0.005)


def measure(cmd: list[str], cwd: Path, env: dict[str, str]) -> Sample:
    """Run ``cmd`` once; its wall time and memory peaks."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _RUSAGE_WRAPPER, *cmd],
        cwd=cwd,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    stop, peak = threading.Event(), [0]
    sampler = threading.Thread(target=_sample_tree, args=(proc.pid, stop, peak), daemon=True)
    sampler.start()
    _, err = proc.communicate(timeout=300)
    stop.set()
    sampler.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd} failed with exit code {proc.returncode}:\n{err}")
    wall, maxrss = err.strip().splitlines()[-1].split()
    return Sample(float(wall), int(maxrss), peak[0])


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # both launchers use bytecode caches
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    for name in list(env):
        if name.startswith("PET_"):
            del env[name]
    return env


def _plot(
    result: dict[str, dict[str, float]],
    ratios: dict[str, float],
    args: argparse.Namespace,
    path: Path,
) -> None:
    sys.path.insert(0, str(ROOT))
    from benchmarks import _plots

    names = ["torchrun", "aelastic"]
    wall = {
        f"{name} ({result[name]['wall_s_median']:.2f} s)": [result[name]["wall_s_median"]]
        for name in names
    }
    memory = {
        name: [result[name]["peak_process_mib"], result[name]["peak_tree_mib"]] for name in names
    }
    _plots.bars(
        [
            (f"wall time ({ratios['wall']}x)", "seconds", ["start to exit"], wall),
            ("memory", "MiB", ["peak launcher RSS", "peak process-tree RSS"], memory),
        ],
        path,
        title=f"Launching a no-op script, --standalone --nproc-per-node {args.nproc}, "
        f"median of {args.runs}",
        note=_plots.footnote("torchrun and aelastic run measured in the same run"),
    )
    print(f"wrote {path}", file=sys.stderr)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description="aelastic run vs torchrun: launch time and memory")
    p.add_argument("--runs", type=int, default=5, help="measured runs of each launcher")
    p.add_argument("--nproc", type=int, default=1, help="workers (--nproc-per-node)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--plot", type=Path, help="write the medians as a PNG bar chart here")
    args = p.parse_args(argv)

    env = _env()
    with tempfile.TemporaryDirectory(prefix="aelastic-launch-") as tmp:
        cwd = Path(tmp)
        (cwd / "noop.py").write_text("pass\n")
        common = ["--standalone", f"--nproc-per-node={args.nproc}", "noop.py"]
        launchers = {
            "aelastic": [sys.executable, "-m", "aelastic", "run", "-q", *common],
            "torchrun": [sys.executable, "-m", "torch.distributed.run", *common],
        }
        for cmd in launchers.values():  # warm-up: bytecode caches, page cache
            measure(cmd, cwd, env)
        samples: dict[str, list[Sample]] = {name: [] for name in launchers}
        for _ in range(args.runs):
            for name, cmd in launchers.items():
                samples[name].append(measure(cmd, cwd, env))

    def median(name: str, field: str) -> float:
        return statistics.median(getattr(s, field) for s in samples[name])

    result = {
        name: {
            "wall_s_median": round(median(name, "wall"), 3),
            "wall_s_min": round(min(s.wall for s in samples[name]), 3),
            "peak_process_mib": round(median(name, "peak_process_kib") / 1024, 1),
            "peak_tree_mib": round(median(name, "peak_tree_kib") / 1024, 1),
        }
        for name in launchers
    }
    ours, theirs = result["aelastic"], result["torchrun"]
    ratios = {
        "wall": round(theirs["wall_s_median"] / ours["wall_s_median"], 2),
        "peak_process": round(theirs["peak_process_mib"] / ours["peak_process_mib"], 2),
        "peak_tree": round(theirs["peak_tree_mib"] / ours["peak_tree_mib"], 2),
    }
    report = {
        "runs": args.runs,
        "nproc_per_node": args.nproc,
        "results": result,
        "ratios_torchrun_over_aelastic": ratios,
        "target_5x_faster_met": ratios["wall"] >= 5,
        "cpu_count": len(os.sched_getaffinity(0)),
        "load_average": os.getloadavg()[0],
        "benchmark_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    if args.plot is not None:
        _plot(result, ratios, args, args.plot)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"no-op script, --standalone --nproc-per-node {args.nproc}, {args.runs} runs each")
    print(f"{'':10} {'wall median':>12} {'wall min':>9} {'peak process':>13} {'peak tree':>10}")
    for name, row in result.items():
        print(
            f"{name:10} {row['wall_s_median']:>10.3f} s {row['wall_s_min']:>7.3f} s "
            f"{row['peak_process_mib']:>9.1f} MiB {row['peak_tree_mib']:>6.1f} MiB"
        )
    print(
        f"torchrun / aelastic: wall {ratios['wall']}x, peak process {ratios['peak_process']}x, "
        f"peak tree {ratios['peak_tree']}x "
        f"(target >= 5x faster: {'met' if report['target_5x_faster_met'] else 'NOT met'}; "
        f"load average {report['load_average']:.2f} on {report['cpu_count']} CPUs)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
