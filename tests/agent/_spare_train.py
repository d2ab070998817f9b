"""A real gloo training loop (CPU) for the spare and in-place tests:
``python _spare_train.py MODE`` with MODE ``inplace`` (``aelastic.worker.InPlace``) or
``plain`` (no aelastic in it: restarts go on from the newest checkpoint in ``$TRAIN_DIR``;
with ``TRAIN_LINGER`` set, a worker whose collective raised takes that many seconds to exit).

Every rank trains the same linear model on the same data, its gradients averaged over the
group, so the model after ``TRAIN_STEPS`` steps is the one a single process gets: each rank
checks that at the end. Each step is reported as a JSON datagram to ``TRAIN_ADDR`` (step,
rank, world size, pid, the agent's pid, restart count, loss); the end too (``done``, ``ok``).
"""

from __future__ import annotations

import os
import sys
import time

if os.environ.get("AELASTIC_INPLACE_TRACE"):
    sys.stderr.write(f"aelastic-inplace {time.time():.3f} {os.getpid()} script starts\n")
import atexit
import datetime
import glob
import json
import socket

import torch
import torch.distributed as dist

if os.environ.get("AELASTIC_INPLACE_TRACE"):
    sys.stderr.write(f"aelastic-inplace {time.time():.3f} {os.getpid()} torch imported\n")

STEPS = int(os.environ.get("TRAIN_STEPS", "30"))
PAUSE = float(os.environ.get("TRAIN_PAUSE", "0.05"))
_HOST, _PORT = os.environ["TRAIN_ADDR"].rsplit(":", 1)
_SOCK = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
X = torch.arange(8.0).reshape(2, 4) / 8
Y = torch.tensor([[1.0], [2.0]])


def report(**fields: object) -> None:
    fields.update(pid=os.getpid(), agent=os.getppid(), t=time.time())
    fields["restart"] = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    _SOCK.sendto(json.dumps(fields).encode(), (_HOST, int(_PORT)))


def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def one_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, group: bool) -> float:
    optimizer.zero_grad()
    loss = ((model(X) - Y) ** 2).mean()
    loss.backward()
    if group:
        for p in model.parameters():
            assert p.grad is not None
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
    optimizer.step()
    return float(loss)


def right(model: torch.nn.Module) -> bool:
    reference, optimizer = make()
    for _ in range(STEPS):
        one_step(reference, optimizer, False)
    pairs = zip(model.parameters(), reference.parameters(), strict=True)
    return all(torch.allclose(a, b, atol=1e-6) for a, b in pairs)


def in_place() -> None:
    import aelastic.worker

    model, optimizer = make()
    state = {"model": model, "optimizer": optimizer, "step": 0}

    def train(round: aelastic.worker.Round) -> None:
        while state["step"] < STEPS:
            loss = one_step(model, optimizer, True)
            state["step"] += 1
            report(
                event="step",
                step=state["step"],
                rank=round.rank,
                world=round.world_size,
                loss=loss,
                gen=round.number,
            )
            time.sleep(PAUSE)

    aelastic.worker.InPlace(state, backend="gloo", timeout=30).run(train)
    report(event="done", ok=right(model), rank=dist.get_rank())


def plain() -> None:
    directory = os.environ["TRAIN_DIR"]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    model, optimizer = make()
    step = 0
    saved = [torch.load(p) for p in glob.glob(os.path.join(directory, "*.pt"))]
    if saved:
        newest = max(saved, key=lambda s: s["step"])
        model.load_state_dict(newest["model"])
        optimizer.load_state_dict(newest["optimizer"])
        step = newest["step"]
    rank, world = dist.get_rank(), dist.get_world_size()
    while step < STEPS:
        try:
            loss = one_step(model, optimizer, True)
        except Exception:
            # ``TRAIN_LINGER`` s of teardown after the collective raised (its exception is
            # uncaught: torch and NCCL teardowns can take that long).
            if linger := float(os.environ.get("TRAIN_LINGER", "0")):
                atexit.register(time.sleep, linger)
            raise
        step += 1
        path = os.path.join(directory, f"{rank}.pt")
        torch.save(
            {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
            path + ".tmp",
        )
        os.replace(path + ".tmp", path)
        report(event="step", step=step, rank=rank, world=world, loss=loss, gen=0)
        time.sleep(PAUSE)
    report(event="done", ok=right(model), rank=rank)


if __name__ == "__main__":
    in_place() if sys.argv[1] == "inplace" else plain()
    if dist.is_initialized():
        dist.destroy_process_group()
