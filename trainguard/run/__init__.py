"""The rank's side of trainguard: ``trainguard.init()``, the ``Run`` a training script holds, and
what it reads and sends (its environment, telemetry, the agent's plan, step timing).

Nothing here imports torch at module level: the node agent imports parts of this package."""
