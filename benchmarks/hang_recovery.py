"""Hang detection: its cost per optimizer step, and the time from a hang to the restarted group.

Two measurements, printed:

* **progress cost**: what the worker bootstrap adds to every optimizer step (torch's global
  optimizer step hook writing two integers to the shared page). Measured in one process: the
  hook called directly (the whole per-step cost, precise), and ``optimizer.step()`` of a small
  model timed with and without the hook (blocks interleaved, the fastest block of each, as
  ``timeit`` does: the end-to-end view, noisier). The goal is < 5 us per step.
* **hang to restart**: one agent, two workers (no torch: the benchmark is about the agent);
  after five steps the worker of rank 1 hangs inside a step on attempt 0. From the moment it
  hangs (its own clock, written before it sleeps) to the stall being reported
  (``WorkerStalled``, stacks taken) and to the next attempt's workers running
  (``WorkersStarted``), for a few stall timeouts: ``restart = timeout + x``. ``auto`` (the
  default: the bound learned from the steps, here 10 s, the floor, and the look from
  outside at its half and its end) is measured against that bound.

Run: ``python benchmarks/hang_recovery.py [--steps 40000] [--blocks 200] [--repeat 3]
[--timeouts 1,2,5,auto]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aelastic.agent import ElasticAgent, WorkerSpec, WorkersStarted, WorkerStalled
from aelastic.agent.health.hang_rule import FLOOR
from aelastic.agent.health.progress import ProgressPages
from aelastic.core.events import Event
from aelastic.rendezvous import RendezvousParameters, create_handler

HEAL_WORKER = str(Path(__file__).resolve().parent.parent / "tests" / "agent" / "heal_worker.py")


def progress_cost(steps: int, blocks: int) -> tuple[float, float, float]:
    """(direct hook call, optimizer.step without, with the hook), microseconds per step."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    pages = ProgressPages(1)
    os.environ.update(pages.env(0))
    try:
        from aelastic.worker._site import _aelastic_worker as runtime

        model = torch.nn.Linear(16, 16)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        runtime.progress()  # attach once (maps the page, arms the stacks signal)
        hook = runtime._on_optimizer_step
        per_block = steps // blocks

        def timed(call: Callable[[], object]) -> float:
            t0 = time.perf_counter()
            for _ in range(per_block):
                call()
            return (time.perf_counter() - t0) / per_block * 1e6

        direct = min(timed(lambda: hook(optimizer, (), {})) for _ in range(blocks))
        without, with_hook = [], []
        for _ in range(blocks):  # interleaved: a slow moment of the machine hits both
            without.append(timed(optimizer.step))
            handle = register_optimizer_step_post_hook(hook)
            with_hook.append(timed(optimizer.step))
            handle.remove()
        # The fastest block of each (timeit's rule: slower ones measured the machine's load).
        return direct, min(without), min(with_hook)
    finally:
        pages.close()
        del os.environ["AELASTIC_PROGRESS_FILE"]


async def hang_once(timeout: float | str) -> tuple[float, float]:
    """(hang -> reported, hang -> next workers running), seconds."""
    with tempfile.TemporaryDirectory(prefix="aelastic-hang-") as tmp:
        params = RendezvousParameters(
            "memory", "bench", f"hang-{uuid.uuid4().hex[:8]}", 1, 1, last_call_timeout=0.1
        )
        spec = WorkerSpec(
            "trainer",
            2,
            create_handler(params),
            sys.executable,
            (HEAL_WORKER, "hang", "1"),
            env={"HEAL_DIR": tmp},
            stall_timeout=timeout,
            max_restarts=1,
            stop_grace_period=5,
        )
        agent = ElasticAgent(spec)
        events: list[Event] = []
        agent.add_listener(events.append)
        result = await agent.run()
        assert not result.is_failed(), result.failures
        hung_at = float(Path(tmp, "hang").read_text())  # noqa: ASYNC240 - the run is over
    [stalled] = [e for e in events if isinstance(e, WorkerStalled)]
    started = [e for e in events if isinstance(e, WorkersStarted)][1]
    return stalled.at - hung_at, started.at - hung_at


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40000)
    parser.add_argument("--blocks", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--timeouts", default="1,2,5")
    args = parser.parse_args(argv)

    direct, without, with_hook = progress_cost(args.steps, args.blocks)
    print(f"progress cost per optimizer step ({args.steps} steps, {os.cpu_count()} CPUs):")
    print(f"  the hook itself (called directly):        {direct:6.3f} us")
    print(f"  optimizer.step() of Linear(16, 16), SGD:  {without:6.2f} us without the hook")
    print(
        f"                                            {with_hook:6.2f} us with it "
        f"({with_hook - without:+.2f} us; fastest of {args.blocks} interleaved blocks)"
    )
    print(f"  goal < 5 us per step: {'met' if direct < 5 else 'NOT met'}")
    print()
    print(
        "hang -> reported (stacks taken) -> next attempt running, medians of "
        f"{args.repeat} (seconds):"
    )
    print(f"  {'timeout':>8} {'reported':>9} {'running':>9} {'x = running - timeout':>22}")
    for asked in args.timeouts.split(","):
        timeout: float | str = asked if asked == "auto" else float(asked)
        bound = FLOOR if timeout == "auto" else float(timeout)
        runs = [asyncio.run(hang_once(timeout)) for _ in range(args.repeat)]
        reported = statistics.median(r[0] for r in runs)
        running = statistics.median(r[1] for r in runs)
        print(f"  {asked:>8} {reported:9.2f} {running:9.2f} {running - bound:22.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
