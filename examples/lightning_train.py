"""A Lightning training script with one trainguard line (the callback).

    trainguard run --nproc 2 -- python examples/lightning_train.py --steps 200

Under ``trainguard run`` (or torchrun) Lightning finds torchrun's environment and runs one process
per rank; alone it trains on one CPU process.
"""

from __future__ import annotations

import argparse
import os

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainguard.integrations.lightning import TrainguardCallback

DIM = 32


class Regressor(pl.LightningModule):
    def __init__(self, width: int = 128, lr: float = 0.05) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(DIM, width), nn.Tanh(), nn.Linear(width, 1))
        self.lr = lr

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        if self.global_rank == 0 and self.global_step % 20 == 0:
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            print(f"step {self.global_step} loss {loss.item():.5f} restart {attempt}", flush=True)
        return loss

    def configure_optimizers(self) -> dict[str, object]:
        opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def dataset(n: int = 4096) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, DIM, generator=g)
    w = torch.randn(DIM, 1, generator=torch.Generator().manual_seed(7))
    return TensorDataset(x, torch.sin(x @ w))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--width", type=int, default=128)
    args = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
                         max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[TrainguardCallback()])
    loader = DataLoader(dataset(), batch_size=args.batch, shuffle=True, generator=torch.Generator().manual_seed(1))
    trainer.fit(Regressor(args.width), loader)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
