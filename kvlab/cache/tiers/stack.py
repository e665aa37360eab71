"""TierStack: the tiers below the device, fastest first, and the policies that move blocks.

Blocks are immutable once computed (a key names one prefix's K/V), so a tier may keep a
copy after the block is loaded back up: tiers are inclusive, and writing a key that a tier
already holds only refreshes its LRU position.
"""

from __future__ import annotations

from kvlab.cache.codecs import StoredKV
from kvlab.cache.tiers.base import Key, Tier
from kvlab.cache.tiers.config import TierConfig
from kvlab.cache.tiers.policies import LOAD_POLICIES, WRITE_POLICIES, LoadPolicy, WritePolicy
from kvlab.cache.tiers.registry import TIERS


class TierStack:
    """Tiers below the device pool, fastest first, with one write and one load policy."""

    def __init__(self, tiers: list[Tier], write: WritePolicy, load: LoadPolicy):
        if not tiers:
            raise ValueError("TierStack needs at least one tier")
        self.tiers, self.write, self.load = tiers, write, load

    @classmethod
    def from_config(cls, config: TierConfig) -> TierStack:
        tiers = [TIERS[name].from_config(config) for name in config.tiers]
        return cls(tiers, WRITE_POLICIES[config.write](), LOAD_POLICIES[config.load]())

    def tier(self, name: str) -> Tier:
        for tier in self.tiers:
            if tier.name == name:
                return tier
        raise ValueError(f"no tier named {name!r} in this stack ({[t.name for t in self.tiers]})")

    def where(self, key: Key) -> str | None:
        """The fastest tier holding `key`, or None."""
        return next((tier.name for tier in self.tiers if key in tier), None)

    def __contains__(self, key: object) -> bool:
        return any(key in tier for tier in self.tiers)

    def get(self, key: Key, salt: str | None) -> tuple[StoredKV | None, str | None]:
        """(stored codes, tier name) from the fastest tier that serves `key` under `salt`,
        or (None, None). A corrupt copy is dropped and the next tier is tried."""
        for tier in self.tiers:
            if key in tier:
                stored = tier.get(key, salt)
                if stored is not None:
                    return stored, tier.name
        return None, None

    def save(self, key: Key, salt: str | None, stored: StoredKV, level: int = 0) -> None:
        """Write a block into tier `level`; what each tier evicts goes one tier down."""
        entries = [(key, salt, stored)]
        for tier in self.tiers[level:]:
            entries = [evicted for entry in entries for evicted in tier.put(*entry)]

    def save_everywhere(self, key: Key, salt: str | None, stored: StoredKV) -> None:
        """Write-through: the block into every tier."""
        for level in range(len(self.tiers)):
            self.save(key, salt, stored, level)

    def spill(self, level: int = 0) -> int:
        """Move every block of tier `level` one tier down (experiments, the notebook:
        to put blocks on disk on purpose). Returns the number moved."""
        tier, moved = self.tiers[level], 0
        if level + 1 >= len(self.tiers):
            raise ValueError(f"tier {tier.name!r} is the last one: nothing below to spill into")
        for key in tier.keys():
            salt = tier.salt_of(key)
            stored = tier.get(key, salt)
            tier.discard(key)
            if stored is not None:
                self.save(key, salt, stored, level + 1)
                moved += 1
        return moved

    def discard(self, key: Key) -> list[str]:
        """Drop `key` from every tier; the names of the tiers that held it."""
        return [tier.name for tier in self.tiers if tier.discard(key)]

    def blocks(self) -> dict[str, int]:
        """Blocks held per tier."""
        return {tier.name: len(tier) for tier in self.tiers}

    def stats(self) -> dict[str, dict]:
        """Per tier: blocks and bytes held, and its TierStats."""
        return {
            tier.name: {"blocks": len(tier), "bytes": tier.nbytes, **tier.stats.as_dict()}
            for tier in self.tiers
        }

    def check_integrity(self) -> None:
        for tier in self.tiers:
            tier.check_integrity()

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()
