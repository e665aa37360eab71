"""The interface every KV tier implements, and the accounting each one keeps.

A tier maps a block key (the hash prefix index's chained key: parent key, the block's
token ids, the salt) to what the codec stores for that block (`StoredKV`: codes and
scales, moved as they are). Every entry also remembers its salt: `get` with another salt
is refused and counted, so even a key collision could not leak a block across tenants.
A tier is bounded (`capacity_blocks`) and evicts least recently used entries first;
`put` returns what it evicted so the stack can write it one tier further down.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass

from kvlab.cache.codecs import StoredKV

Key = bytes  # a chained block key (kvlab.cache.prefix.hash)
Entry = tuple[Key, str | None, StoredKV]  # key, salt, stored codes


@dataclass
class TierStats:
    """What a tier has done since it was made: counts, bytes and measured seconds."""

    saves: int = 0  # blocks written into this tier
    loads: int = 0  # blocks read back out (hits served)
    misses: int = 0  # lookups this tier could not serve
    evictions: int = 0  # entries pushed out by capacity (LRU)
    discards: int = 0  # entries dropped on purpose (a session ended)
    corrupt: int = 0  # entries whose checksum or length failed: dropped, never served
    salt_refusals: int = 0  # lookups under another salt than the entry's: refused
    bytes_saved: int = 0
    bytes_loaded: int = 0
    save_s: float = 0.0  # wall time spent writing entries (disk: file write + fsync-free)
    load_s: float = 0.0  # wall time spent reading them (disk: read + checksum)

    def as_dict(self) -> dict:
        return asdict(self)


class Tier(ABC):
    """A bounded store of blocks' stored codes, keyed by chained block keys."""

    name: str | None = None  # set by TIERS.register
    describe: str = ""

    def __init__(self, capacity_blocks: int):
        if capacity_blocks <= 0:
            raise ValueError(
                f"{type(self).__name__}: capacity_blocks={capacity_blocks} must be > 0"
            )
        self.capacity_blocks = capacity_blocks
        self.stats = TierStats()

    @classmethod
    @abstractmethod
    def from_config(cls, config) -> Tier:
        """The tier a `TierConfig` describes."""

    @abstractmethod
    def get(self, key: Key, salt: str | None) -> StoredKV | None:
        """The stored codes of `key` under `salt`, or None (absent, other salt, corrupt)."""

    @abstractmethod
    def put(self, key: Key, salt: str | None, stored: StoredKV) -> list[Entry]:
        """Store a block (an existing key only becomes most recently used); return the
        entries evicted to make room, for the next tier down (a last tier returns [])."""

    @abstractmethod
    def discard(self, key: Key) -> bool:
        """Drop `key` if present; True if it was."""

    @abstractmethod
    def keys(self) -> list[Key]:
        """Keys held, least recently used first."""

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of stored codes held now."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Raise IntegrityError if the accounting disagrees with the contents."""

    def salt_of(self, key: Key) -> str | None:
        """The salt an entry was stored under (KeyError if absent)."""
        raise KeyError(key)

    def __len__(self) -> int:
        return len(self.keys())

    def close(self) -> None:  # noqa: B027  (most tiers hold nothing outside Python)
        """Release what the tier holds outside Python objects (files)."""


class TableTier(Tier):
    """A tier whose contents are a table `entries`: key -> (salt, what it keeps), least
    recently used first, with `_nbytes` of stored codes counted by the subclass."""

    entries: dict

    def _lookup(self, key: Key, salt: str | None) -> tuple | None:
        """The entry of `key` if it is held under `salt`; counts a miss or a refusal."""
        entry = self.entries.get(key)
        if entry is None:
            self.stats.misses += 1
            return None
        if entry[0] != salt:
            self.stats.salt_refusals += 1
            return None
        return entry

    def keys(self) -> list[Key]:
        return list(self.entries)

    def salt_of(self, key: Key) -> str | None:
        return self.entries[key][0]

    def __contains__(self, key: object) -> bool:
        return key in self.entries

    @property
    def nbytes(self) -> int:
        return self._nbytes
