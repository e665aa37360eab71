"""Heavy hitters + recent window (H2O, Zhang et al. 2023), at block granularity.

Besides the blocks of the last `retention_window` tokens, keeps the
`retention_heavy` tokens' worth of older blocks (whole blocks) that received the most
attention so far; the rest are dropped, greedily and for good. The scores are the
attention mass each physical block received, summed over layers, heads and each step's
last `SCORED_ROWS` query rows (one row per decode; the end of a prefill chunk, like
SnapKV's observation window), collected on the torch reference path by
`kvlab.model.scored_attention.ScoredAttention`. A block shared by several sequences
collects everyone's attention.
"""

from __future__ import annotations

import torch

from kvlab.cache.retention.base import RetentionPolicy
from kvlab.cache.retention.registry import RETENTION
from kvlab.units import ceil_div


@RETENTION.register("h2o")
class HeavyHitterRetention(RetentionPolicy):
    observes_attention = True

    def __init__(self, block_size: int, num_blocks: int, window: int, heavy: int):
        super().__init__(block_size, num_blocks)
        self.window = window  # recent tokens kept
        self.heavy = ceil_div(heavy, block_size)  # older blocks kept for their scores
        self.scores = torch.zeros(num_blocks, dtype=torch.float64)  # attention mass per block

    @classmethod
    def from_config(cls, config, num_blocks: int) -> HeavyHitterRetention:
        return cls(config.block_size, num_blocks, config.retention_window, config.retention_heavy)

    def drop(self, table: list[int], num_computed: int) -> list[int]:
        start = self.recent_start(num_computed, self.window)
        older = [i for i in self.candidates(table, num_computed) if i < start]
        if len(older) <= self.heavy:
            return []
        # Lowest score first; ties go to the older block.
        ranked = sorted(older, key=lambda i: (float(self.scores[table[i]]), i))
        return sorted(ranked[: len(older) - self.heavy])

    def kept_blocks(self) -> int:
        return self.heavy + ceil_div(self.window, self.block_size) + 1

    def on_allocate(self, block: int) -> None:
        self.scores[block] = 0.0
