"""``trainguard demo`` and the faults a node puts on a job from outside it (CPU cgroups, hogs),
which the demo, the benchmarks and the tests use."""
