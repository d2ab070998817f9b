"""Worker functions for the launcher's tests, as torch users write them (module level:
what a spawned worker unpickles by name)."""

from __future__ import annotations

import datetime
import os
from typing import Any


def all_reduce_rank() -> float:
    """The sum of rank + 1 over the world, by gloo (torch's own code)."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        value = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(value)
        return float(value.item())
    finally:
        dist.destroy_process_group()


def fail_on_rank_one(message: str) -> int:
    if os.environ["RANK"] == "1":
        raise ValueError(message)
    return 0


def put_rank(queue: Any, tag: str) -> str:
    queue.put((tag, int(os.environ["RANK"])))
    return tag


def rank_times(factor: int) -> int:
    return factor * int(os.environ["RANK"])
