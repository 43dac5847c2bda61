"""Recovery: acts on what agent.detect finds once per tick, times each recovery, and picks what every
(re)start of a job restores (the newest verified checkpoint across tiers, or the ranks' snapshots)."""
