"""Per-step snapshots of a rank's state in shared memory: taking them (``writer``), restoring
them (``load``), and sharing data-parallel replicas out among the ranks (``replicas``)."""
