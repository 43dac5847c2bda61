"""Failure detection and recovery: hangs (with stacks), loss divergence (rollback), rank exits
(restart from the newest verified checkpoint across tiers), crash loops, rank exclusion."""
