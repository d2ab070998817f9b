"""Hugging Face accelerate's ``Accelerator`` training under ``aelastic run`` (CPU, gloo).

    aelastic run --standalone --nproc-per-node 2 examples/accelerate_train.py

``Accelerator()`` reads torch's elastic environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``...) that aelastic sets, as under torchrun, and joins the
process group. Needs ``pip install accelerate``.
"""

from __future__ import annotations

import sys

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    x = torch.rand(256, 1)
    data = DataLoader(TensorDataset(x, 3 * x - 1), batch_size=32)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    for _ in range(5):
        for inputs, targets in data:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
    layer = accelerator.unwrap_model(model)
    weight, bias = layer.weight.item(), layer.bias.item()
    # One write per line: the ranks share the console, and print()'s separate write of the
    # newline could let another rank's line in between.
    sys.stdout.write(
        f"[accelerate] rank {accelerator.process_index} of {accelerator.num_processes} "
        f"({accelerator.distributed_type}): y = {weight:.2f}*x {bias:+.2f}\n"
    )
    sys.stdout.flush()
    # The prepared model (DDP) holds the process group: released first, the group's
    # destruction in end_training() is its last; left to the interpreter's exit, gloo's
    # threads are torn down during finalization, which aborts the process (SIGABRT,
    # "terminate called without an active exception") about one exit in ten, under any
    # launcher.
    model, optimizer, data = accelerator.free_memory(model, optimizer, data)
    accelerator.end_training()


if __name__ == "__main__":
    main()
