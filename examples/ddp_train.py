"""A real DistributedDataParallel training loop that survives restarts and world-size changes.

Run it (one machine, two workers, nothing else to start)::

    aelastic run --standalone --nproc-per-node 2 examples/ddp_train.py

How it works: every worker builds the same small model, wraps it in DDP (gloo on CPU, nccl on
GPUs) and trains on a synthetic regression task (learn ``y = 3*x0 - 2*x1 + 0.5``). The global
batch is fixed and split across however many workers there are, so the maths stays the same
when the world grows or shrinks. Rank 0 writes a checkpoint (model, optimizer, step) every few
steps, atomically; every worker loads it at start. So when the launcher restarts the workers
(a crash, a node lost, a node added), training resumes from the last checkpoint with the new
world size instead of starting over.

The checkpoint lives in ``--checkpoint-dir`` (default: a directory named after the job id,
``TORCHELASTIC_RUN_ID``, under the temp directory). ``--crash-at-step N`` makes rank
``--crash-rank`` fail once (on the first attempt) to show a restart; ``--step-time`` slows the
steps so that there is time to kill or add nodes.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

# torch warns on import when NumPy is missing (it is not one of torch's requirements, and
# this example does not use it).
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

GLOBAL_BATCH = 64
TRUE_WEIGHT = torch.tensor([3.0, -2.0])
TRUE_BIAS = 0.5


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40, help="training steps in all")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step")
    p.add_argument("--crash-at-step", type=int, default=None, help="fail once at this step")
    p.add_argument("--crash-rank", type=int, default=0, help="the rank that fails")
    return p.parse_args(argv)


def log(message: str) -> None:
    """Print on global rank 0 only, so the console shows one story."""
    if dist.get_rank() == 0:
        print(f"[ddp_train] {message}", flush=True)


def batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of the global batch of ``step`` (deterministic in the step)."""
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(GLOBAL_BATCH, 2, generator=generator)
    y = x @ TRUE_WEIGHT + TRUE_BIAS + 0.01 * torch.randn(GLOBAL_BATCH, generator=generator)
    return x[rank::world_size], y[rank::world_size].unsqueeze(1)


def checkpoint_path(args: argparse.Namespace) -> Path:
    root = args.checkpoint_dir or os.path.join(
        tempfile.gettempdir(), f"aelastic-ddp-{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}"
    )
    return Path(root) / "checkpoint.pt"


def save(path: Path, model: torch.nn.Module, optimizer: Any, step: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    state = {"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict()}
    torch.save(state, tmp)
    os.replace(tmp, path)  # atomic: a crash never leaves half a checkpoint


def load(path: Path, model: torch.nn.Module, optimizer: Any) -> int:
    if not path.exists():
        return 0
    state = torch.load(path, map_location="cpu")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"])


@record
def main(argv: list[str]) -> None:
    args = parse_args(argv)
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    path = checkpoint_path(args)
    start = load(path, model, optimizer)
    ddp = DistributedDataParallel(model.to(device), device_ids=[device.index] if use_cuda else None)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    where = f"resuming at step {start}" if start else "starting from scratch"
    log(f"world size {world} ({'nccl' if use_cuda else 'gloo'}), attempt {attempt}, {where}")
    loss = torch.tensor(0.0)
    for step in range(start, args.steps):
        if step == args.crash_at_step and rank == args.crash_rank and attempt == 0:
            raise RuntimeError(f"simulated crash of rank {rank} at step {step}")
        x, y = batch(step, rank, world)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x.to(device)), y.to(device))
        loss.backward()  # DDP averages the gradients of every rank here
        optimizer.step()
        done = step + 1
        if done % args.checkpoint_every == 0 or done == args.steps:
            if rank == 0:
                save(path, model, optimizer, done)
            dist.barrier()
            log(f"step {done}/{args.steps}  loss {loss.item():.4f}  (checkpoint saved)")
        if args.step_time:
            time.sleep(args.step_time)
    # DDP's reducer holds gloo work objects: let it go while the interpreter is whole (at
    # exit, tearing them down after the process group can abort the process: SIGABRT).
    del ddp
    gc.collect()
    weight = model.weight.detach().cpu().flatten().tolist()
    log(
        f"done: {args.steps} steps, loss {loss.item():.4f}, learned y = {weight[0]:.2f}*x0 "
        f"{weight[1]:+.2f}*x1 {model.bias.item():+.2f} (true: 3*x0 - 2*x1 + 0.5)"
    )
    dist.barrier()  # every rank is done with the checkpoint
    if rank == 0 and args.checkpoint_dir is None:
        shutil.rmtree(path.parent, ignore_errors=True)  # the default one lives in the temp dir
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
