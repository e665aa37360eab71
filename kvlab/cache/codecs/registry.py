"""The KV codecs' registry (`EngineConfig.kv_codec` names one); each codec file registers
its class here."""

from __future__ import annotations

from kvlab.cache.codecs.base import KVCodec
from kvlab.registry import Registry

CODECS: Registry[type[KVCodec]] = Registry("KV codec", "kv_codec")
