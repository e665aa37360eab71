"""TierConfig: which tiers sit below the device pool, how big, and their policies."""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.cache.tiers.policies import LOAD_POLICIES, WRITE_POLICIES
from kvlab.cache.tiers.registry import TIERS


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass
class TierConfig:
    """The KV hierarchy below the device pool (`EngineConfig.tiers`).

    Attributes:
        tiers: names in kvlab.cache.tiers.TIERS, fastest first: ("host",), ("disk",) or
            ("host", "disk").
        host_blocks: blocks the host tier holds (LRU beyond that).
        disk_blocks: blocks the disk tier holds (LRU beyond that).
        disk_dir: the disk tier's directory; None: a temporary one, removed on close.
        write: "write-back" or "write-through" (kvlab.cache.tiers.WRITE_POLICIES).
        load: "promote-on-hit" or "prefetch-on-queue" (kvlab.cache.tiers.LOAD_POLICIES).
    """

    tiers: tuple[str, ...] = ("host",)
    host_blocks: int = 256
    disk_blocks: int = 1024
    disk_dir: str | None = None
    write: str = "write-back"
    load: str = "promote-on-hit"

    def __post_init__(self) -> None:

        if isinstance(self.tiers, str):
            self.tiers = (self.tiers,)
        self.tiers = tuple(self.tiers)
        _require(bool(self.tiers), "TierConfig.tiers=() is empty: name at least one tier")
        _require(
            len(set(self.tiers)) == len(self.tiers),
            f"TierConfig.tiers={self.tiers} names a tier twice",
        )
        for name in self.tiers:
            _require(
                name in TIERS and name is not None,
                f"TierConfig.tiers: {name!r} is unknown; choose from {TIERS.names()}",
            )
        for name in ("host_blocks", "disk_blocks"):
            value = getattr(self, name)
            _require(
                isinstance(value, int) and value > 0, f"TierConfig.{name}={value!r} must be > 0"
            )
        for field, registry in (("write", WRITE_POLICIES), ("load", LOAD_POLICIES)):
            value = getattr(self, field)
            _require(
                value in registry.names(),
                f"TierConfig.{field}={value!r} is unknown; choose one of {registry.names()}",
            )
