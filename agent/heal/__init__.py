"""Healing actions the agent takes on its own: rollback (rollback.py), exclusion of a data-parallel
replica (exclusion.py), restarts without a failed GPU (gpu_faults.py), shard migration
(migration.py); their counter (counts.py)."""
