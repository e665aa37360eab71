"""Prefix indexes: which physical blocks already hold the K/V of a token prefix.

The interface every index implements (`PrefixIndex`), and what a lookup returns
(`PrefixMatch`). Indexes are registered parts (`PREFIX_INDEXES`); a class attribute
`token_granular` says whether `match` may return a partly matching block to copy from.
A salt (tenant / cache namespace) is part of every key, so requests with different salts
never share a block.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass(frozen=True)
class PrefixMatch:
    blocks: list[int]  # full blocks whose tokens equal the prompt's first len(blocks) blocks
    partial_block: int | None = None  # a block whose first `partial_tokens` slots also match
    partial_tokens: int = 0


class PrefixIndex(ABC):
    name: str | None = None  # set by PREFIX_INDEXES.register
    token_granular: bool = False  # match() may return a partial block to copy from
    emits_events: bool = False  # reports stores and removals to an event sink (KV events)

    def __init__(self, block_size: int):
        self.block_size = block_size

    @classmethod
    def from_config(cls, config, events=None) -> PrefixIndex:
        """The index an EngineConfig describes; `events`: a kvlab.cache.events.EventSink
        (only an index that `emits_events` takes one)."""
        if events is not None:
            raise ValueError(
                f"KV events need prefix_caching='hash' (prefix_caching={cls.name!r} "
                "reports no block hashes)"
            )
        return cls(config.block_size)

    @abstractmethod
    def match(self, tokens: list[int], salt: str | None) -> PrefixMatch:
        """The longest cached prefix of `tokens` under `salt`."""

    @abstractmethod
    def insert(
        self, tokens: list[int], blocks: list[int], salt: str | None, partial: bool = False
    ) -> None:
        """Index the blocks holding `tokens` (block i holds tokens[i*bs:(i+1)*bs]).

        Full blocks always; the last, partly filled block too if `partial` (radix only).
        A prefix already indexed under another block keeps its block.
        """

    @abstractmethod
    def remove(self, block: int) -> list[int]:
        """Forget an evicted block; return other blocks that became unreachable."""

    @abstractmethod
    def __contains__(self, block: int) -> bool: ...
