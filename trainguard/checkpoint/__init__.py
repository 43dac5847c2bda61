"""Rank-side checkpointing: DCP checkpoints into the agent's memory tier, the background writer
that saves them, safe loading, the RNG state both keep, and per-step snapshots (``snapshot``).

The agent's side of the same files lives in ``trainguard.agent.checkpoint``."""
