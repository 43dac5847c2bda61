"""trainguard node agent. Never imports torch: it starts fast and stays small beside the ranks."""

__version__ = "0.1.0"
