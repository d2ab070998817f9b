"""A real torch.distributed worker: gloo all-reduce over the agent's environment."""

from __future__ import annotations

import datetime
import os


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
