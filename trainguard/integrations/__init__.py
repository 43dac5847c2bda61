"""Framework adapters: one callback each, thin, on top of the public API (``trainguard.init``).

* ``trainguard.integrations.lightning.TrainguardCallback`` (``pip install trainguard[lightning]``)
* ``trainguard.integrations.hf.TrainguardCallback`` (``pip install trainguard[hf]``)

Both report every optimizer step (with compute and optimizer phases, loss and LR), apply the
agent's plan LR on top of the framework's own schedule, stop when the plan says so, save model,
optimizer and LR scheduler into the memory tier when due, and after a restart by the agent restore
them and continue the step count. What they cannot do: move samples between ranks (the framework
owns the data loader, so ``plan.batch_size`` is reported, not applied), and the data order starts
its epoch again after a restore (the framework's own resume replays it; ours does not).
"""
