"""trainguard node agent. Never imports torch (see SPEC.md, interfaces)."""

__version__ = "0.1.0"
