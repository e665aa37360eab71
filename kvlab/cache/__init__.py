"""KV-cache variants behind one interface (`KVCache`), over one physical store (`KVPool`).

Variants are registered parts (`CACHES`), named by `EngineConfig.cache`: "naive" (one
contiguous max_model_len region per sequence) and "paged" (blocks through a block table).
A new variant is one file with a `@CACHES.register("name")` class implementing `KVCache`.
"""

from __future__ import annotations

import torch

from kvlab.cache.allocator import BlockAllocator, OutOfBlocks
from kvlab.cache.base import KVCache, MemoryStats, make_pool
from kvlab.cache.pool import KVPool
from kvlab.cache.prefix import PREFIX_INDEXES, HashPrefixIndex, RadixPrefixIndex
from kvlab.cache.spec import KVSpec
from kvlab.registry import Registry

CACHES: Registry[type[KVCache]] = Registry("KV cache", "cache")

from kvlab.cache.naive import NaiveCache  # noqa: E402  (registers "naive")
from kvlab.cache.paged import PagedCache  # noqa: E402  (registers "paged")


def make_cache(
    config, spec: KVSpec, dtype: torch.dtype, device: torch.device, max_model_len: int
) -> KVCache:
    """The cache `config.cache` names, over a pool sized by the config's KV budget and
    stored through the codec `config.kv_codec` names."""
    cache = CACHES[config.cache]
    pool = make_pool(config, cache, spec, dtype, device, max_model_len)
    return cache.from_config(config, pool, max_model_len)


__all__ = [
    "CACHES",
    "BlockAllocator",
    "HashPrefixIndex",
    "KVCache",
    "KVPool",
    "KVSpec",
    "MemoryStats",
    "NaiveCache",
    "OutOfBlocks",
    "PREFIX_INDEXES",
    "PagedCache",
    "RadixPrefixIndex",
    "make_cache",
]
