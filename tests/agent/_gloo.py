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


def main() -> None:
    """``python _gloo.py``: an all-reduce in a group made by ``aelastic.worker.InPlace``,
    then the end of the script with the group still alive (no ``destroy_process_group``)."""
    import aelastic.worker

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
