"""Prefix caching: indexes from token prefixes to the blocks that hold their K/V.

Registered parts (`PREFIX_INDEXES`), named by `EngineConfig.prefix_caching`: "hash"
(chained hashes of full blocks, as vLLM) and "radix" (a token-granular radix tree, as
SGLang). A new index is one file with a `@PREFIX_INDEXES.register("name")` class
implementing `PrefixIndex`.
"""

from __future__ import annotations

from kvlab.cache.prefix.base import PrefixIndex, PrefixMatch
from kvlab.cache.prefix.hash import HashPrefixIndex  # registers "hash"
from kvlab.cache.prefix.radix import RadixPrefixIndex  # registers "radix"
from kvlab.cache.prefix.registry import PREFIX_INDEXES

__all__ = ["PREFIX_INDEXES", "HashPrefixIndex", "PrefixIndex", "PrefixMatch", "RadixPrefixIndex"]
