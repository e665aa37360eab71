"""The prefix indexes' registry (`EngineConfig.prefix_caching` names one); each index file
registers its class here."""

from __future__ import annotations

from kvlab.cache.prefix.base import PrefixIndex
from kvlab.registry import Registry

PREFIX_INDEXES: Registry[type[PrefixIndex]] = Registry("prefix index", "prefix_caching")
