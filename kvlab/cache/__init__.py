"""KV-cache variants behind one interface (`KVCache`), over one physical store (`KVPool`).

Variants are registered parts (`CACHES`), named by `EngineConfig.cache`: "naive" (one
contiguous max_model_len region per sequence), "paged" (blocks through a block table) and
"hybrid" (a block table per KV cache group of a model that mixes layer kinds).
A new variant is one file with a `@CACHES.register("name")` class implementing `KVCache`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from kvlab.cache.allocator import BlockAllocator, OutOfBlocks
from kvlab.cache.base import KVCache, MemoryStats, make_pool
from kvlab.cache.check import check_config
from kvlab.cache.events import EventSink
from kvlab.cache.groups import KVCacheGroup, kv_cache_groups
from kvlab.cache.hybrid import HybridCache  # registers "hybrid"
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
    pattern: tuple[int | None, ...] | None = None,
) -> KVCache:
    """The cache `config.cache` names, over a pool sized by the config's KV budget and
    stored through the codec `config.kv_codec` names. `attach` wraps the pool before the
    cache takes it (tensor parallel: every rank mirrors it). `events`: a sink for the KV
    events of its prefix index (kvlab.cache.events). `pattern`: each layer's sliding
    window (kvlab.model.pattern; None: every layer full), which the hybrid cache groups
    layers by: its pool holds one group's layers per block."""
    check_config(config)
    cache = CACHES[config.cache]
    if events is not None and not cache.emits_events:
        raise ValueError(f"KV events need cache='paged' with prefix caching; got {config.cache!r}")
    extra = {} if events is None else {"events": events}
    model_spec = spec
    if cache is HybridCache:
        groups = kv_cache_groups(pattern or (None,) * spec.num_layers)
        extra["groups"] = groups
        spec = dataclasses.replace(spec, num_layers=max(len(g.layers) for g in groups))
    pool = make_pool(config, cache, spec, dtype, device, max_model_len, model_spec)
    pool = attach(pool) if attach else pool
    return cache.from_config(config, pool, max_model_len, **extra)


__all__ = [
    "CACHES",
    "BlockAllocator",
    "HashPrefixIndex",
    "HybridCache",
    "KVCacheGroup",
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
    "kv_cache_groups",
    "make_cache",
]
