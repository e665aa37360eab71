"""Prefix caching: indexes from token prefixes to the blocks that hold their K/V.

Registered parts (`PREFIX_INDEXES`), named by `EngineConfig.prefix_caching`: "hash"
(chained hashes of full blocks, as vLLM) and "radix" (a token-granular radix tree, as
SGLang). A new index is one file with a `@PREFIX_INDEXES.register("name")` class
implementing `PrefixIndex`.
"""

from __future__ import annotations

from kvlab.cache.prefix.base import PrefixIndex, PrefixMatch
from kvlab.registry import Registry

PREFIX_INDEXES: Registry[type[PrefixIndex]] = Registry("prefix index", "prefix_caching")

from kvlab.cache.prefix.hash import HashPrefixIndex  # noqa: E402  (registers "hash")
from kvlab.cache.prefix.radix import RadixPrefixIndex  # noqa: E402  (registers "radix")

__all__ = ["PREFIX_INDEXES", "HashPrefixIndex", "PrefixIndex", "PrefixMatch", "RadixPrefixIndex"]
