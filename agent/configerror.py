"""The error a bad config value raises: one line naming the key (``section.field: why``). Its own
module so that each section's config, and the light CLI, import it without the whole config."""

from __future__ import annotations


class ConfigError(ValueError):
    def __init__(self, key: str, why: str) -> None:
        super().__init__(f"{key}: {why}")
        self.key = key
        self.why = why
