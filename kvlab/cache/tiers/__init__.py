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

from kvlab.cache.tiers.base import Tier, TierStats
from kvlab.registry import Registry

TIERS: Registry[type[Tier]] = Registry("KV tier", "tiers.tiers")

# isort: off
from kvlab.cache.tiers.host import HostTier  # noqa: E402  (registers "host")
from kvlab.cache.tiers.disk import DiskTier  # noqa: E402  (registers "disk")
from kvlab.cache.tiers.policies import LOAD_POLICIES, WRITE_POLICIES  # noqa: E402
from kvlab.cache.tiers.config import TierConfig  # noqa: E402
from kvlab.cache.tiers.stack import TierStack  # noqa: E402
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
