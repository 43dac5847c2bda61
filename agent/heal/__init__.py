"""Healing actions the agent takes on its own (shard migration: migration.py)."""
