"""The KV caches' registry (`EngineConfig.cache` names one); each cache file registers its
class here."""

from __future__ import annotations

from kvlab.cache.base import KVCache
from kvlab.registry import Registry

CACHES: Registry[type[KVCache]] = Registry("KV cache", "cache")
