"""KV-cache variants behind one interface (`KVCache`), over one physical store (`KVPool`)."""

from __future__ import annotations

import torch

from kvlab.cache.base import KVCache, MemoryStats
from kvlab.cache.block_allocator import BlockAllocator, OutOfBlocks
from kvlab.cache.naive import NaiveCache
from kvlab.cache.paged import PagedCache
from kvlab.cache.pool import KVPool, KVSpec
from kvlab.config import DEFAULT_BUDGET_TOKENS, EngineConfig


def make_cache(
    config: EngineConfig,
    spec: KVSpec,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
) -> KVCache:
    """The cache `config.cache` names, over a pool sized by the config's KV budget."""
    per_token = spec.bytes_per_token(dtype)
    if config.kv_budget_bytes is not None:
        slots = config.kv_budget_bytes // per_token
    else:
        slots = config.kv_budget_tokens or DEFAULT_BUDGET_TOKENS
    unit = max_model_len if config.cache == "naive" else config.block_size
    slots -= slots % unit
    if slots == 0:
        what = f"max_model_len={max_model_len}" if config.cache == "naive" else "one block"
        raise ValueError(
            f"KV budget holds fewer token slots ({per_token} bytes each) than {what}: "
            f"too small for even one {config.cache} sequence"
        )
    pool = KVPool(spec, slots, dtype, device)
    if config.cache == "naive":
        return NaiveCache(pool, max_model_len, config.poison_freed)
    return PagedCache(pool, config.block_size, max_model_len, config.poison_freed)


__all__ = [
    "BlockAllocator",
    "KVCache",
    "KVPool",
    "KVSpec",
    "MemoryStats",
    "NaiveCache",
    "OutOfBlocks",
    "PagedCache",
    "make_cache",
]
