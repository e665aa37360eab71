"""KV-cache variants behind one interface (`KVCache`), over one physical store (`KVPool`).

Variants are registered parts (`CACHES`), named by `EngineConfig.cache`: "naive" (one
contiguous max_model_len region per sequence) and "paged" (blocks through a block table).
A new variant is one file with a `@CACHES.register("name")` class implementing `KVCache`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvlab.cache.allocator import BlockAllocator, OutOfBlocks
from kvlab.cache.base import KVCache, MemoryStats, make_pool
from kvlab.cache.check import check_config
from kvlab.cache.events import EventSink
from kvlab.cache.naive import NaiveCache  # registers "naive"
from kvlab.cache.paged import PagedCache  # registers "paged"
from kvlab.cache.pool import KVPool
from kvlab.cache.prefix import PREFIX_INDEXES, HashPrefixIndex, RadixPrefixIndex
from kvlab.cache.registry import CACHES
from kvlab.cache.spec import KVSpec


def make_cache(
    config,
    spec: KVSpec,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
    attach: Callable[[KVPool], KVPool] | None = None,
    events: EventSink | None = None,
) -> KVCache:
    """The cache `config.cache` names, over a pool sized by the config's KV budget and
    stored through the codec `config.kv_codec` names. `attach` wraps the pool before the
    cache takes it (tensor parallel: every rank mirrors it). `events`: a sink for the KV
    events of its prefix index (kvlab.cache.events)."""
    check_config(config)
    cache = CACHES[config.cache]
    if events is not None and not cache.emits_events:
        raise ValueError(f"KV events need cache='paged' with prefix caching; got {config.cache!r}")
    pool = make_pool(config, cache, spec, dtype, device, max_model_len)
    pool = attach(pool) if attach else pool
    if events is None:
        return cache.from_config(config, pool, max_model_len)
    return cache.from_config(config, pool, max_model_len, events=events)


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
    "check_config",
    "make_cache",
]
