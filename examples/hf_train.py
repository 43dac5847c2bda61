"""A Hugging Face ``Trainer`` script with one trainguard line (the callback).

    trainguard run --nproc 2 -- python examples/hf_train.py --steps 200

The model is a small regression network (the Trainer takes any ``nn.Module`` whose forward returns
a dict with ``loss``); nothing is downloaded. Under ``trainguard run`` or torchrun the Trainer reads
torchrun's environment and trains data-parallel on gloo.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn
from transformers import Trainer, TrainingArguments

from trainguard.integrations.hf import TrainguardCallback

DIM = 32


class Regressor(nn.Module):
    def __init__(self, width: int = 128) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(DIM, width), nn.Tanh(), nn.Linear(width, 1))

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        out = self.net(x)
        result = {"logits": out}
        if labels is not None:
            result["loss"] = nn.functional.mse_loss(out, labels)
        return result


class Samples(torch.utils.data.Dataset):
    def __init__(self, n: int = 4096) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, DIM, generator=g)
        w = torch.randn(DIM, 1, generator=torch.Generator().manual_seed(7))
        self.y = torch.sin(self.x @ w)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--output-dir", default=os.path.join(os.getcwd(), "hf-out"))
    args = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    targs = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch,
        learning_rate=0.05, lr_scheduler_type="linear", logging_steps=20, save_strategy="no", report_to=[],
        use_cpu=True, ddp_backend="gloo", dataloader_num_workers=0, disable_tqdm=True, seed=0,
    )
    trainer = Trainer(model=Regressor(), args=targs, train_dataset=Samples(), callbacks=[TrainguardCallback()])
    trainer.train()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
