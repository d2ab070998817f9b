"""Worker functions of the agent and launcher scenarios, as torch's tests write them (module
level, so that a spawned worker finds them by name)."""

from __future__ import annotations

import os


def happy_function() -> None:
    return None


def sad_function() -> None:
    raise RuntimeError("sad because i throw")


def echo(msg: str) -> str:
    return msg


def simple_rank_scale() -> int:
    return 10 + int(os.environ["RANK"])


def function_with_bug() -> None:
    raise RuntimeError("test error")


def dist_sum() -> int:
    """The sum of the ranks over the world, by gloo (torch's ``_dist_sum``)."""
    import datetime

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    try:
        value = torch.tensor(int(os.environ["RANK"]))
        dist.all_reduce(value)
        return int(value.item())
    finally:
        dist.destroy_process_group()
