"""KV-cache variants behind one interface (`KVCache`), over one physical store (`KVPool`)."""

from __future__ import annotations

import torch

from kvlab.cache.base import KVCache, MemoryStats
from kvlab.cache.block_allocator import BlockAllocator, OutOfBlocks
from kvlab.cache.codecs import codec_class
from kvlab.cache.naive import NaiveCache
from kvlab.cache.paged import PagedCache
from kvlab.cache.pool import KVPool, KVSpec
from kvlab.cache.prefix_index import PREFIX_INDEXES, HashPrefixIndex, RadixPrefixIndex
from kvlab.config import DEFAULT_BUDGET_TOKENS, EngineConfig


def make_cache(
    config: EngineConfig,
    spec: KVSpec,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
) -> KVCache:
    """The cache `config.cache` names, over a pool sized by the config's KV budget.

    The pool stores K/V through the codec `config.kv_dtype` names; a byte budget buys
    budget // (its bytes per token, scales included) slots.
    """
    codec = codec_class(config.kv_dtype)
    per_token = codec.token_bytes(spec, dtype)
    if config.kv_budget_bytes is not None:
        slots = config.kv_budget_bytes // per_token
    else:
        slots = config.kv_budget_tokens or DEFAULT_BUDGET_TOKENS
    unit = max_model_len if config.cache == "naive" else config.block_size
    if unit % codec.alignment:
        field = "max_model_len" if config.cache == "naive" else "block_size"
        raise ValueError(
            f"EngineConfig.{field}={unit} must be a multiple of {codec.alignment} "
            f"for kv_dtype={config.kv_dtype!r} (it quantizes keys in groups of that many tokens)"
        )
    slots -= slots % unit
    if slots == 0:
        what = f"max_model_len={max_model_len}" if config.cache == "naive" else "one block"
        raise ValueError(
            f"KV budget holds fewer token slots ({per_token} bytes each) than {what}: "
            f"too small for even one {config.cache} sequence"
        )
    pool = KVPool(spec, slots, dtype, device, config.kv_dtype)
    if config.cache == "naive":
        return NaiveCache(pool, max_model_len, config.poison_freed)
    index = (
        PREFIX_INDEXES[config.prefix_caching](config.block_size) if config.prefix_caching else None
    )
    watermark = config.watermark if config.admission == "watermark" else None
    return PagedCache(pool, config.block_size, max_model_len, config.poison_freed, index, watermark)


__all__ = [
    "BlockAllocator",
    "KVCache",
    "KVPool",
    "KVSpec",
    "MemoryStats",
    "NaiveCache",
    "OutOfBlocks",
    "PagedCache",
    "HashPrefixIndex",
    "RadixPrefixIndex",
    "make_cache",
]
