"""The KV tiers' registry (`TierConfig.tiers` names them); each tier file registers its class
here. The write and load policies' registries live with the policies (policies.py)."""

from __future__ import annotations

from kvlab.cache.tiers.base import Tier
from kvlab.registry import Registry

TIERS: Registry[type[Tier]] = Registry("KV tier", "tiers.tiers")
