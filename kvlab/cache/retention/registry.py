"""The retention policies' registry (`EngineConfig.retention` names one); each policy file
registers its class here."""

from __future__ import annotations

from kvlab.cache.retention.base import RetentionPolicy
from kvlab.registry import Registry

RETENTION: Registry[type[RetentionPolicy]] = Registry("retention policy", "retention")
