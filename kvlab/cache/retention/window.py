"""Sliding window: only the blocks holding the last `retention_window` tokens stay.

Whole blocks that fall out of the window go back to the free list, as vLLM's hybrid
allocator frees the blocks a sliding-window layer no longer sees. Between
`retention_window` and `retention_window + block_size - 1` tokens stay (plus the tail
block being written). Without sinks the first tokens leave too, which StreamingLLM shows
makes the model lose its footing once they go (see sinks.py).
"""

from __future__ import annotations

from kvlab.cache.retention.base import RetentionPolicy
from kvlab.cache.retention.registry import RETENTION
from kvlab.units import ceil_div


@RETENTION.register("window")
class WindowRetention(RetentionPolicy):
    def __init__(self, block_size: int, num_blocks: int, window: int):
        super().__init__(block_size, num_blocks)
        self.window = window  # recent tokens kept

    @classmethod
    def from_config(cls, config, num_blocks: int) -> WindowRetention:
        return cls(config.block_size, num_blocks, config.retention_window)

    def drop(self, table: list[int], num_computed: int) -> list[int]:
        start = self.recent_start(num_computed, self.window)
        return [i for i in self.candidates(table, num_computed) if i < start]

    def kept_blocks(self) -> int:
        return ceil_div(self.window, self.block_size) + 1
