"""A real gloo training loop (CPU, torch, 2 ranks) for hang detection's defaults, with no line
of aelastic in it: ``python _hang_train.py MODE`` (files go to ``$HANG_DIR``).

* ``sleep``: 30 steps of about 50 ms; on attempt 0, rank 1 sleeps forever inside step 5
  (after four optimizer steps), after writing the time to ``$HANG_DIR/hang``.
* ``init``: on attempt 0, rank 1 never starts its process group (it prepares data: it reads
  a file over and over, torch imported), so rank 0 waits in ``init_process_group``; on
  attempt 1 both train 3 steps.
* ``evals``: 40 steps of 50 to 150 ms; every 10 steps an evaluation (forward passes, no
  optimizer step) 3x as long as the slowest training step so far.
* ``long``: 8 steps; a 20 s evaluation (forward passes on the CPU, no step); a checkpoint
  that rank 0 writes for 15 s (64 KiB at a time) while rank 1 waits in a barrier; a data
  pass where rank 1 waits 15 s for a file that a thread writes slowly; 8 more steps.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

HANG_DIR = os.environ.get("HANG_DIR", ".")


def main() -> int:
    mode = sys.argv[1]
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if mode == "init" and attempt == 0 and os.environ["RANK"] == "1":
        data = os.path.join(HANG_DIR, "data")
        with open(data, "wb") as f:
            f.write(os.urandom(128 * 1024))
        while True:  # never starts its group: busy (reading), so never hung itself
            with open(data, "rb") as f:
                f.read()
            time.sleep(0.1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))  # the init line
    rank = dist.get_rank()
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def train_step(step: int, pause: float = 0.05) -> None:
        loss = model(torch.randn(16, 32)).pow(2).mean()
        loss.backward()
        for p in model.parameters():
            assert p.grad is not None
            dist.all_reduce(p.grad)
        if mode == "sleep" and rank == 1 and attempt == 0 and step == 5:
            with open(os.path.join(HANG_DIR, "hang"), "w") as f:
                f.write(repr(time.time()))
            time.sleep(3600)  # the stuck line
        optimizer.step()
        optimizer.zero_grad()
        time.sleep(pause)

    def evaluate(seconds: float) -> None:
        end = time.monotonic() + seconds
        with torch.no_grad():
            while time.monotonic() < end:
                model(torch.randn(256, 32))
        done = torch.ones(1)
        dist.all_reduce(done)

    if mode == "sleep":
        for step in range(1, 31):
            train_step(step)
    elif mode == "init":
        for step in range(1, 4):
            train_step(step)
    elif mode == "evals":
        slowest = 0.0
        for step in range(1, 41):
            started = time.monotonic()
            train_step(step, 0.05 + 0.1 * (step % 3) / 2)
            slowest = max(slowest, time.monotonic() - started)
            if step % 10 == 0:
                evaluate(3 * slowest)
    elif mode == "long":
        for step in range(1, 9):
            train_step(step)
        evaluate(20.0)
        if rank == 0:
            with open(os.path.join(HANG_DIR, "checkpoint"), "wb") as f:
                end = time.monotonic() + 15.0
                while time.monotonic() < end:
                    f.write(os.urandom(64 * 1024))
                    f.flush()
                    time.sleep(0.05)
        dist.barrier()
        if rank == 1:
            shard = os.path.join(HANG_DIR, "shard")
            open(shard, "wb").close()
            threading.Thread(target=_write_slowly, args=(shard, 15.0), daemon=True).start()
            while not os.path.exists(shard + ".done"):
                with open(shard, "rb") as f:
                    f.read()
                time.sleep(0.05)
        dist.barrier()
        for step in range(9, 17):
            train_step(step)
    print(f"rank {rank} finished on attempt {attempt}", flush=True)
    dist.destroy_process_group()
    return 0


def _write_slowly(path: str, seconds: float) -> None:
    end = time.monotonic() + seconds
    with open(path, "ab") as f:
        while time.monotonic() < end:
            f.write(b"x" * 4096)
            f.flush()
            time.sleep(0.1)
    open(path + ".done", "w").close()


if __name__ == "__main__":
    sys.exit(main())
