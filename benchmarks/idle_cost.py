"""Idle cost: CPU time the agent process itself uses while its workers run and do nothing.

8 workers sleep (20 s by default); the CPU seconds (user + system, all threads) of the
launcher process alone, not of its workers, are read from ``/proc`` between the moment
the last worker reported its start and just before the first one exits. aelastic's agent
(embedded memory rendezvous; warm standbys on, the default, and off: standbys are separate
idle processes, not counted) and ``torchrun --standalone`` run in the same invocation.

Run: ``python benchmarks/idle_cost.py [--quick] [--sleep 20] [--nproc 8]``
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._agent_bench import (
    Reports,
    aelastic_node_cmd,
    env_for,
    finish,
    launched,
    torchrun_cmd,
)

TICK = 1.0 / os.sysconf("SC_CLK_TCK")
MARGIN = 1.0  # seconds kept clear of the workers' start and exit


def cpu_seconds(pid: int) -> float:
    """CPU seconds of process ``pid`` (all its threads, not its children).

    Nanoseconds from each thread's ``schedstat`` (the clock-tick counts of ``stat`` are
    too coarse for an idle process); ``stat`` where schedstat is missing.
    """
    total = 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        return total / 1e9
    except (OSError, ValueError, IndexError):
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) * TICK


def measure(command: list[str], nproc: int, sleep: float, warm: bool = True) -> tuple[float, float]:
    """(CPU seconds of the launcher, window seconds) while ``nproc`` workers sleep."""
    reports = Reports()
    env = env_for(reports, BENCH_SLEEP=str(sleep), BENCH_WARM=str(int(warm)))
    try:
        with launched([command], env) as procs:
            deadline = time.monotonic() + 120
            starts = []
            while len(starts) < nproc:
                words = reports.next(deadline)
                if words[0] == "start":
                    starts.append(float(words[3]))
            # The window: from now until just before the first worker wakes up.
            time.sleep(MARGIN)
            window = min(starts) + sleep - MARGIN - time.time()
            if window <= 1.0:
                raise RuntimeError(f"--sleep {sleep} is too short for {nproc} workers here")
            before = cpu_seconds(procs[0].pid)
            time.sleep(window)
            used = cpu_seconds(procs[0].pid) - before
            finish(procs)
    finally:
        reports.close()
    return used, window


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sleep", type=float, default=20.0, help="seconds the workers sleep")
    parser.add_argument("--nproc", type=int, default=8, help="workers")
    parser.add_argument("--quick", action="store_true", help="workers sleep 6 s")
    args = parser.parse_args(argv)
    sleep = 6.0 if args.quick else args.sleep
    n = args.nproc

    torch_args = ["--standalone", "--nproc-per-node", str(n), "--max-restarts", "0"]
    cases = [
        ("torchrun --standalone", torchrun_cmd(torch_args, "sleep"), True),
        ("aelastic", aelastic_node_cmd("memory", "local", "idle", 1, n, 0, "sleep"), True),
        (
            "aelastic, warm standby off",
            aelastic_node_cmd("memory", "l", "idle", 1, n, 0, "sleep"),
            False,
        ),
    ]
    results = []
    for name, command, warm in cases:
        command = [c.replace("idle", f"idle-{uuid.uuid4().hex[:8]}") for c in command]
        used, window = measure(command, n, sleep, warm)
        print(f"  {name}: {used:.3f} CPU s in {window:.1f} s", file=sys.stderr)
        results.append((name, used, window))

    torch_rate = results[0][1] / results[0][2]
    print(f"Idle cost: launcher CPU while {n} workers sleep {sleep:g} s (lower is better)")
    print(f"{'launcher':<28} {'CPU s':>8} {'window s':>9} {'CPU %':>7} {'torch / it':>11}")
    for name, used, window in results:
        rate = used / window
        ratio = f"{torch_rate / rate:.1f}x" if rate > 0 else "inf"
        print(f"{name:<28} {used:>8.4f} {window:>9.1f} {100 * rate:>6.3f}% {ratio:>11}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
