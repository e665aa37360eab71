"""Attention sinks + sliding window (StreamingLLM, Xiao et al. 2023).

Keeps the first `retention_sinks` tokens (rounded up to whole blocks: block granularity)
and the last `retention_window` tokens. Models put large attention weight on the first
tokens whatever they say; keeping them lets a windowed cache stay stable far past the
window, at a memory cost flat in the context length.
"""

from __future__ import annotations

from kvlab.cache.retention.base import RetentionPolicy
from kvlab.cache.retention.registry import RETENTION
from kvlab.units import ceil_div


@RETENTION.register("sinks")
class SinksRetention(RetentionPolicy):
    def __init__(self, block_size: int, num_blocks: int, window: int, sinks: int):
        super().__init__(block_size, num_blocks)
        self.window = window  # recent tokens kept
        self.sinks = ceil_div(sinks, block_size)  # first blocks kept

    @classmethod
    def from_config(cls, config, num_blocks: int) -> SinksRetention:
        return cls(config.block_size, num_blocks, config.retention_window, config.retention_sinks)

    def drop(self, table: list[int], num_computed: int) -> list[int]:
        start = self.recent_start(num_computed, self.window)
        return [i for i in self.candidates(table, num_computed) if self.sinks <= i < start]

    def kept_blocks(self) -> int:
        return self.sinks + ceil_div(self.window, self.block_size) + 1
