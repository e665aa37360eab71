"""KV tiers: where an evicted cached block goes instead of being thrown away.

The device pool is the top of the hierarchy; below it sit registered tiers (`TIERS`),
fastest first: "host" (a bounded LRU dict of the codec's stored bytes in host memory) and
"disk" (a bounded directory, one checksummed file per block). A block's key is the hash
prefix index's chained key (parent key, token ids, salt), so a tier never serves a block to
another salt or another prefix. `TierStack` chains the tiers; the policies
(`WRITE_POLICIES`: when blocks are written down, `LOAD_POLICIES`: when they come back up)
are registered parts too. `kvlab.cache.connector.TierConnector` wires a stack to the paged
cache behind an interface named like vLLM's KV connector.

A new tier is one file with a `@TIERS.register("name")` class implementing `Tier`.
"""

from __future__ import annotations

# isort: off
from kvlab.cache.tiers.base import Tier, TierStats
from kvlab.cache.tiers.registry import TIERS
from kvlab.cache.tiers.host import HostTier  # registers "host"
from kvlab.cache.tiers.disk import DiskTier  # registers "disk"
from kvlab.cache.tiers.policies import LOAD_POLICIES, WRITE_POLICIES
from kvlab.cache.tiers.config import TierConfig
from kvlab.cache.tiers.stack import TierStack
# isort: on

__all__ = [
    "LOAD_POLICIES",
    "TIERS",
    "WRITE_POLICIES",
    "DiskTier",
    "HostTier",
    "Tier",
    "TierConfig",
    "TierStack",
    "TierStats",
]
