"""``TrainguardCallback`` for Lightning: ``Trainer(callbacks=[TrainguardCallback()])``.

One ``run.step`` per optimizer step: opened at ``on_train_batch_start`` (compute phase), switched
to the optimizer phase at ``on_before_optimizer_step`` (where the plan's LR is applied on top of
whatever the LR scheduler set, and put back after the step, so the scheduler's own sequence is
untouched), closed at ``on_train_batch_end`` with the loss and LR. After the step the memory-tier
checkpoint is taken when due; at ``on_train_start`` the checkpoint the agent picked is restored
and the loop's step counter moved to it. See ``trainguard.integrations`` for what it cannot do.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

import trainguard
from trainguard.run import rendezvous_clock
from trainguard.run.run import Run
from trainguard.run.step import Step

APPLIES = ("lr", "stop")
"""What of the agent's plan this callback applies (``trainguard.init(applies=...)``)."""

# The framework brings its process group up before the callback's init (a Hugging Face Trainer while
# it is built): timed from here, a recovery's timeline tells the rendezvous from the script's start-up.
rendezvous_clock.watch()


def batch_samples(batch: Any) -> int:
    """Samples in a batch of tensors (a tensor, a tuple/list of them, or a dict of them)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.ndim else 1
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, list | tuple) and batch:
        return batch_samples(batch[0])
    return 0


class TrainguardCallback(Callback):
    def __init__(self, run: Run | None = None) -> None:
        self.run = run
        self._step: Step | None = None
        self._base_lrs: list[float] = []
        self.restored_step = 0

    def _state(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        state: dict[str, Any] = {"model": pl_module}
        for i, opt in enumerate(trainer.optimizers):
            state["optim" if i == 0 else f"optim{i}"] = opt
        for i, cfg in enumerate(trainer.lr_scheduler_configs):
            state["sched" if i == 0 else f"sched{i}"] = cfg.scheduler
        return state

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.run is None:
            # Lightning owns the data loader: its batch size is the script's, never the plan's.
            self.run = trainguard.init(dp_rank=trainer.global_rank, dp_size=trainer.world_size, applies=APPLIES)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self.run is not None
        self.run.watch_gradients(pl_module.parameters())
        start = self.run.restore(self._state(trainer, pl_module))
        if start:
            self.restored_step = start
            # Lightning's global_step is its count of optimizer steps: continue it from the checkpoint
            # (max_steps, schedules keyed on the step and logging follow).
            progress = trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total
            progress.ready = progress.completed = start
            trainer.fit_loop.epoch_loop._batches_that_stepped = start

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        assert self.run is not None
        self._step = self.run.step(trainer.global_step, samples=batch_samples(batch))
        self._step.__enter__()
        self._step.switch("compute")

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        assert self.run is not None
        if self._step is not None:
            self._step.switch("optim")
        self._base_lrs = [g["lr"] for g in optimizer.param_groups]
        for group, base in zip(optimizer.param_groups, self._base_lrs, strict=True):
            group["lr"] = self.run.plan.lr_for(base)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        assert self.run is not None
        lr = None
        if trainer.optimizers and self._base_lrs:
            groups = trainer.optimizers[0].param_groups
            lr = float(groups[0]["lr"])
            for group, base in zip(groups, self._base_lrs, strict=True):
                group["lr"] = base
            self._base_lrs = []
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if self._step is not None:
            self._step.report(loss=float(loss.detach()) if isinstance(loss, torch.Tensor) else None, lr=lr)
            self._step.__exit__(None, None, None)
            self._step = None
        self.run.checkpoint(trainer.global_step - 1, self._state(trainer, pl_module))
        if self.run.plan.stop:
            trainer.should_stop = True

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._step = None

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.run is not None:
            self.run.close()
