"""A real torch training loop over gloo (CPU) for the self-healing tests:
``python _gloo_heal.py MODE`` (no change for aelastic in it: no progress call, no @record).

* ``hang``: six SGD steps with the gradients all-reduced; on attempt 0, rank 1 sleeps forever
  inside its fourth step (``train_step``) after writing the time to ``$HEAL_DIR/hang``.
* ``raise``: one all-reduce, then rank 1 raises ``ValueError`` while rank 0 goes on to the next
  all-reduce (which breaks: its peer is gone).
* ``train``: steps (a twentieth of a second apart) until ``$HEAL_DIR/finish`` exists; in a
  world of 2, after its third step, each worker writes its pid to ``$HEAL_DIR/$HEAL_NODE.pid``.
"""

from __future__ import annotations

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist


def main() -> int:
    mode = sys.argv[1]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def train_step(step: int) -> None:
        loss = model(torch.ones(1, 4)).sum()
        loss.backward()
        for p in model.parameters():
            assert p.grad is not None
            dist.all_reduce(p.grad)
        if mode == "hang" and rank == 1 and attempt == 0 and step == 3:
            with open(os.path.join(os.environ["HEAL_DIR"], "hang"), "w") as f:
                f.write(repr(time.time()))
            time.sleep(3600)  # the stuck line
        if mode == "raise" and rank == 1:
            raise ValueError("the data shard 7 is corrupt")
        optimizer.step()
        optimizer.zero_grad()

    if mode == "train":
        step = 0
        while not os.path.exists(os.path.join(os.environ["HEAL_DIR"], "finish")):
            train_step(step)
            step += 1
            if step == 3 and dist.get_world_size() == 2:
                pid_file = os.path.join(os.environ["HEAL_DIR"], os.environ["HEAL_NODE"] + ".pid")
                with open(pid_file + ".tmp", "w") as f:
                    f.write(str(os.getpid()))
                os.replace(pid_file + ".tmp", pid_file)
            time.sleep(0.05)
    for step in range(0 if mode == "train" else 6):
        train_step(step)
    print(f"rank {rank} finished on attempt {attempt}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
