"""The training worker of the node-loss benchmark (torch, gloo, CPU).

``python _train_worker.py MODE``: every rank trains the same small model, its gradients
all-reduced over the group, and reports each finished step as a UDP datagram to
``BENCH_ADDR``: ``step <rank> <step> <wall time> <pid> <group generation>``. Modes:

* ``checkpoint``: what torchrun users do. At start, the newest checkpoint in ``BENCH_DIR``
  is loaded (model, optimizer, step); each rank writes its own after every step
  (``torch.save`` to a temporary file, then a rename). A node loss costs a restart of the
  process: interpreter, ``import torch``, process group, checkpoint.
* ``inplace``: :class:`aelastic.worker.InPlace`, the state in memory: a node loss costs a new
  process group and the hand-over to the newcomer, in the same process.
"""

from __future__ import annotations

import datetime
import glob
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

PAUSE = float(os.environ.get("BENCH_PAUSE", "0.05"))
_HOST, _PORT = os.environ["BENCH_ADDR"].rsplit(":", 1)
_SOCK = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
X = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))


def report(rank: int, step: int, gen: int) -> None:
    line = f"step {rank} {step} {time.time()!r} {os.getpid()} {gen}"
    _SOCK.sendto(line.encode(), (_HOST, int(_PORT)))


def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def one_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    model(X).pow(2).mean().backward()
    for p in model.parameters():
        assert p.grad is not None
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    optimizer.step()


def trace(what: str) -> None:
    """With ``BENCH_TRACE_DIR`` set, a timed line on stderr (the launcher's log)."""
    if os.environ.get("BENCH_TRACE_DIR"):
        print(f"{time.time():.3f} worker {os.getpid()}: {what}", file=sys.stderr, flush=True)


def checkpointed() -> None:
    directory = os.environ["BENCH_DIR"]
    trace(f"starts, master {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    trace(f"group made, rank {dist.get_rank()}")
    model, optimizer = make()
    step = 0
    saved = [torch.load(p) for p in glob.glob(os.path.join(directory, "*.pt"))]  # each rank's
    if saved:
        newest = max(saved, key=lambda s: s["step"])
        model.load_state_dict(newest["model"])
        optimizer.load_state_dict(newest["optimizer"])
        step = newest["step"]
    trace(f"{len(saved)} checkpoints read")
    rank = dist.get_rank()
    path = os.path.join(directory, f"{rank}.pt")
    while True:
        one_step(model, optimizer)
        step += 1
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
        torch.save(state, f"{path}.{os.getpid()}")  # a rank's old and new worker may overlap
        os.replace(f"{path}.{os.getpid()}", path)
        report(rank, step, 0)
        time.sleep(PAUSE)


def in_place() -> None:
    import aelastic.worker

    model, optimizer = make()
    state = {"model": model, "optimizer": optimizer, "step": 0}
    recovery = aelastic.worker.InPlace(state, backend="gloo", timeout=60)

    def train(round: aelastic.worker.Round) -> None:
        while True:
            recovery.check()
            one_step(model, optimizer)
            state["step"] += 1
            report(round.rank, state["step"], round.number)
            time.sleep(PAUSE)

    recovery.run(train)


if __name__ == "__main__":
    in_place() if sys.argv[1] == "inplace" else checkpointed()
