"""A real torch.distributed worker: gloo all-reduce over the agent's environment."""

from __future__ import annotations

import datetime
import os
import sys


def all_reduce() -> dict[str, float | int]:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        value = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(value)
        return {
            "sum": value.item(),
            "rank": dist.get_rank(),
            "world": dist.get_world_size(),
            "local_rank": int(os.environ["LOCAL_RANK"]),
        }
    finally:
        dist.destroy_process_group()


def destroyed_in_a_cycle() -> None:
    """``python _gloo.py --destroyed-in-a-cycle``: a group of one destroyed by the script
    but still referred to from a cycle of objects (as a model wrapped in DDP keeps it)."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    value = torch.tensor([1.0])
    dist.all_reduce(value)
    held: dict[str, object] = {"group": dist.group.WORLD}
    held["self"] = held
    dist.destroy_process_group()
    del held
    print(f"sum {value.item():g}; gloo threads: {_gloo_threads()}", flush=True)


def _gloo_threads() -> bool:
    names = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/comm") as f:
            names.append(f.read().strip())
    return "pt_gloo_runloop" in names


def main() -> None:
    """``python _gloo.py``: an all-reduce in a group made by ``aelastic.worker.InPlace``,
    then the end of the script with the group still alive (no ``destroy_process_group``)."""
    import aelastic.worker

    if "--destroyed-in-a-cycle" in sys.argv:
        destroyed_in_a_cycle()
        if "--run-exit-handlers" in sys.argv:
            import atexit

            atexit._run_exitfuncs()
            print(f"gloo threads after the exit handlers: {_gloo_threads()}", flush=True)
        return

    def train(round: aelastic.worker.Round) -> float:
        import torch
        import torch.distributed as dist

        value = torch.tensor([1.0])
        dist.all_reduce(value)
        return float(value.item())

    total = aelastic.worker.InPlace(None, backend="gloo", timeout=60).run(train)
    print(f"sum {total:g}", flush=True)
    if "--run-exit-handlers" in sys.argv:  # what the interpreter's exit does first
        import atexit

        import torch.distributed as dist

        atexit._run_exitfuncs()
        print(f"group alive after the exit handlers: {dist.is_initialized()}", flush=True)


if __name__ == "__main__":
    main()
