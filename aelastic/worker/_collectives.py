"""The two collectives in-place recovery needs, without numpy.

torch's object collectives (``all_gather_object``, ``broadcast_object_list``) turn their
byte tensors back into bytes with ``tensor.numpy()``, so they fail with "Numpy is not
available" where numpy is not installed (torch's CPU wheels do not require it). Recovery
must not depend on that: :func:`any_flag` gathers one flag per rank as an integer tensor,
and :func:`broadcast_object` sends a pickled object as a byte tensor (its length first) and
reads it back through ``ctypes`` from the tensor's memory. Objects are pickled exactly as
``broadcast_object_list`` pickles them: between the job's own workers, never to a store.

Tensors live on the device the group's backend needs: the current CUDA device for NCCL
alone, the CPU otherwise (gloo, or a backend per device such as ``cpu:gloo,cuda:nccl``).
"""

from __future__ import annotations

import ctypes
import pickle
from typing import Any

__all__ = ["broadcast_object", "first_flagged"]


def _device(dist: Any) -> Any:
    import torch

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def first_flagged(dist: Any, flag: bool) -> int | None:
    """The lowest rank whose ``flag`` is true (``None``: none is); every rank calls it."""
    import torch

    device = _device(dist)
    mine = torch.tensor([1 if flag else 0], dtype=torch.int64, device=device)
    flags = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(flags, mine)
    for rank, value in enumerate(flags):
        if int(value.item()):
            return rank
    return None


def broadcast_object(dist: Any, obj: Any, source: int) -> Any:
    """``obj`` of rank ``source``, on every rank (the others pass anything, e.g. ``None``)."""
    import torch

    device = _device(dist)
    mine = dist.get_rank() == source
    data = pickle.dumps(obj) if mine else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=source)
    if mine:
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    else:
        buffer = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(buffer, src=source)
    if mine:
        return obj
    local = buffer.cpu().contiguous()
    return pickle.loads(ctypes.string_at(local.data_ptr(), local.numel()))
