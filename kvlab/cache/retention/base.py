"""Retention policies: which of a sequence's KV blocks the paged cache keeps as it grows.

A policy looks at a sequence's block table after every step (`PagedCache.retain`) and
names the logical blocks to drop. A dropped block leaves the table as `DROPPED` (-1): the
table keeps its length, so position p still lives in logical block p // block_size and
every kept token keeps its original position. K is stored already rotated by RoPE at
that position, so nothing is re-rotated or renumbered when tokens leave (StreamingLLM
re-numbers positions inside its cache; kvlab keeps the original ones, as its K cache
already holds them). Queries also keep their absolute positions.

Only whole, computed blocks are dropped, never the block the next token is written to.
A dropped block goes back to the allocator; if no other table holds it, it also leaves
the prefix index, so a later prefix hit never lands on it. Attention metadata skips
dropped blocks (kvlab.model.metadata: build_retained_metadata). A step's new tokens always see each
other: a policy acts between steps, so a prefill chunk of C tokens is held in full for
the step that computes it (peak = kept + C tokens).

Policies are registered parts (`RETENTION`, named by `EngineConfig.retention`); a new
one is one file with a `@RETENTION.register("name")` subclass of `RetentionPolicy`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from kvlab.config import EngineConfig

DROPPED = -1  # a block-table entry whose block a retention policy has dropped


def leading_kept(table: list[int]) -> int:
    """Blocks at the start of `table` before the first dropped one (what may be indexed)."""
    return next((i for i, block in enumerate(table) if block == DROPPED), len(table))


class RetentionPolicy(ABC):
    """Decides, after each step, which full blocks of a sequence to drop."""

    name: ClassVar[str]  # set by RETENTION.register
    observes_attention: ClassVar[bool] = False  # needs attention scores (see scores.py)

    def __init__(self, block_size: int, num_blocks: int):
        self.block_size = block_size
        self.num_blocks = num_blocks

    @classmethod
    def from_config(cls, config: EngineConfig, num_blocks: int) -> RetentionPolicy:
        """The policy `config` describes, for a cache of `num_blocks` blocks."""
        return cls(config.block_size, num_blocks)

    def candidates(self, table: list[int], num_computed: int) -> list[int]:
        """Logical blocks that may be dropped: full, computed and not dropped yet."""
        return [i for i in range(num_computed // self.block_size) if table[i] != DROPPED]

    def recent_start(self, num_computed: int, window: int) -> int:
        """First logical block holding one of the last `window` computed tokens."""
        return max(num_computed - window, 0) // self.block_size

    @abstractmethod
    def drop(self, table: list[int], num_computed: int) -> list[int]:
        """Logical block indices of `table` to drop now (`num_computed` tokens are in)."""

    def kept_blocks(self) -> int | None:
        """Most blocks a sequence keeps after `retain` (None: unbounded), plus its tail."""
        return None

    def on_allocate(self, block: int) -> None:
        """A block was just taken from the allocator (score-based policies reset it)."""
        return None
