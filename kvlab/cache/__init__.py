"""KV-cache variants behind one interface (`KVCache`), over one physical store (`KVPool`)."""

from kvlab.cache.base import KVCache, MemoryStats
from kvlab.cache.naive import NaiveCache
from kvlab.cache.pool import KVPool, KVSpec

__all__ = ["KVCache", "KVPool", "KVSpec", "MemoryStats", "NaiveCache"]
