"""PyTorch Lightning's ``Trainer(strategy="ddp")`` under ``aelastic run`` (CPU, gloo).

    aelastic run --standalone --nproc-per-node 2 examples/lightning_ddp.py

Lightning sees torch's elastic environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``...) that aelastic sets, as under torchrun, and starts no processes of its own.
Needs ``pip install lightning``.
"""

from __future__ import annotations

import os
import sys
import warnings

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


class Line(L.LightningModule):
    """Learns y = 3x - 1."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


def main() -> None:
    warnings.filterwarnings("ignore")  # Lightning's advice on workers and logging
    torch.manual_seed(0)
    x = torch.rand(256, 1)
    data = DataLoader(TensorDataset(x, 3 * x - 1), batch_size=32)
    trainer = L.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        num_nodes=int(os.environ.get("GROUP_WORLD_SIZE", "1")),
        max_epochs=5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Line()
    trainer.fit(model, data)
    weight, bias = model.layer.weight.item(), model.layer.bias.item()
    # One write per line: the ranks share the console, and print()'s separate write of the
    # newline could let another rank's line in between.
    sys.stdout.write(
        f"[lightning] rank {trainer.global_rank} of {trainer.world_size}: "
        f"y = {weight:.2f}*x {bias:+.2f}\n"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
