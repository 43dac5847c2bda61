"""``TrainguardCallback`` for the Hugging Face ``Trainer``: ``Trainer(..., callbacks=[TrainguardCallback()])``.

One ``run.step`` per optimizer step, from ``on_step_begin`` (compute phase) through
``on_pre_optimizer_step`` (optimizer phase; the plan's LR is applied on top of the scheduler's and
put back at ``on_optimizer_step``, before the scheduler steps) to ``on_step_end``. The Trainer keeps
its per-step loss to itself (it logs a mean every ``logging_steps``), so the step telemetry carries
the loss only on steps it logged. After each step the memory-tier checkpoint (model, optimizer, LR
scheduler) is taken when due; at ``on_train_begin`` the checkpoint the agent picked is restored and
``state.global_step`` continued from it; ``control.should_training_stop`` follows the plan's stop.
See ``trainguard.integrations`` for what it cannot do.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

import trainguard
from trainguard.run import rendezvous_clock
from trainguard.run.run import Run
from trainguard.run.step import Step

APPLIES = ("lr", "stop")
"""What of the agent's plan this callback applies (``trainguard.init(applies=...)``)."""

# The framework brings its process group up before the callback's init (a Hugging Face Trainer while
# it is built): timed from here, a recovery's timeline tells the rendezvous from the script's start-up.
rendezvous_clock.watch()


def _unwrap(obj: Any) -> Any:
    # accelerate wraps the optimizer and the scheduler; checkpoint the objects they wrap.
    inner = getattr(obj, "optimizer", None) if not isinstance(obj, torch.optim.lr_scheduler.LRScheduler) else None
    if isinstance(inner, torch.optim.Optimizer):
        return inner
    return getattr(obj, "scheduler", obj)


class TrainguardCallback(TrainerCallback):
    def __init__(self, run: Run | None = None) -> None:
        self.run = run
        self._step: Step | None = None
        self._state: dict[str, Any] = {}
        self._base_lrs: list[float] = []
        self._optimizer: Any = None
        self._loss: float | None = None
        self.restored_step = 0

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       model: Any = None, optimizer: Any = None, lr_scheduler: Any = None, **kwargs: Any) -> None:
        if self.run is None:
            # The Trainer owns the data loader: its batch size is the script's, never the plan's. It is
            # told all the same, so that a world change moves the LR by the agent's rule.
            samples = args.per_device_train_batch_size * args.gradient_accumulation_steps
            self.run = trainguard.init(dp_rank=args.process_index, dp_size=args.world_size, batch_size=samples,
                                       applies=APPLIES)
        self._optimizer = optimizer
        if model is not None:
            self.run.watch_gradients(model.parameters())
        self._state = {"model": model}
        if optimizer is not None:
            self._state["optim"] = _unwrap(optimizer)
        if lr_scheduler is not None:
            self._state["sched"] = _unwrap(lr_scheduler)
        start = self.run.restore(self._state)
        if start:
            self.restored_step = start
            state.global_step = start

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                      **kwargs: Any) -> None:
        assert self.run is not None
        samples = args.per_device_train_batch_size * args.gradient_accumulation_steps
        self._step = self.run.step(state.global_step, samples=samples)
        self._step.__enter__()
        self._step.switch("compute")

    def on_pre_optimizer_step(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                              **kwargs: Any) -> None:
        assert self.run is not None
        if self._step is not None:
            self._step.switch("optim")
        if self._optimizer is not None:
            groups = self._optimizer.param_groups
            self._base_lrs = [g["lr"] for g in groups]
            for group, base in zip(groups, self._base_lrs, strict=True):
                group["lr"] = self.run.plan.lr_for(base)

    def on_optimizer_step(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                          **kwargs: Any) -> None:
        if self._optimizer is not None and self._base_lrs:
            groups = self._optimizer.param_groups
            if self._step is not None:
                self._step.report(lr=float(groups[0]["lr"]))
            for group, base in zip(groups, self._base_lrs, strict=True):
                group["lr"] = base
            self._base_lrs = []

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, float] | None = None, **kwargs: Any) -> None:
        loss = (logs or {}).get("loss")
        if isinstance(loss, int | float) and math.isfinite(loss):
            self._loss = float(loss)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        assert self.run is not None
        if self._step is not None:
            if self._loss is not None:
                self._step.report(loss=self._loss)
                self._loss = None
            self._step.__exit__(None, None, None)
            self._step = None
        self.run.checkpoint(state.global_step - 1, self._state)
        if self.run.plan.stop:
            control.should_training_stop = True

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        if self.run is not None:
            self.run.close()
