"""trainguard keeps distributed PyTorch training healthy without a human.

The public API for a training script::

    import trainguard
    run = trainguard.init()                 # no agent: a working no-op run
    start = run.restore(state)              # the step to resume at
    for step in range(start, steps):
        with run.step(step, samples=n, tokens=n * seq) as s:
            ...
            s.report(loss=loss.item(), lr=lr)
        run.checkpoint(step, state)
        plan = run.plan                     # lr_scale/lr, batch_size, loss_weight, checkpoint_now, stop

Framework callbacks: ``trainguard.integrations.lightning`` and ``trainguard.integrations.hf``.
The repository's parts live under this namespace (``trainguard.agent``, ``trainguard.trainer``,
``trainguard.tui``), so a script's own ``agent.py``/``trainer.py``/``tui.py`` never collide with
them. Importing this package loads no torch (the node agent imports it too).
"""

# First: from a checkout that is not installed, trainguard.agent/.trainer/.tui are found from here on.
from trainguard import checkout  # noqa: F401, I001
from trainguard.agent import __version__
from trainguard.run.plan import RunPlan
from trainguard.run.run import Run, init
from trainguard.run.step import Step

__all__ = ["Run", "RunPlan", "Step", "__version__", "init"]
