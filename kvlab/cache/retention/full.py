"""Full retention: every block stays until the sequence finishes (the default)."""

from __future__ import annotations

from kvlab.cache.retention.base import RetentionPolicy
from kvlab.cache.retention.registry import RETENTION


@RETENTION.register("full")
class FullRetention(RetentionPolicy):
    def drop(self, table: list[int], num_computed: int) -> list[int]:
        return []
