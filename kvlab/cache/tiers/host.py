"""The host tier: evicted blocks' stored codes in host memory, a bounded LRU.

What it holds are the `StoredKV` tensors `KVPool.read` copied off the device (on a CPU
machine, another buffer in the same RAM; on a GPU, pinned-free host memory across PCIe).

Swap preemption goes through the same memory: a swapped-out request's blocks are *held*
here (`hold`, counted against the capacity, evicting cached entries one tier down to make
room) until it swaps back in or ends (`release`). A hold is never refused: the scheduler
has already preempted; if holds alone exceed the capacity, no cached entry stays.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from kvlab.cache.codecs import StoredKV
from kvlab.cache.tiers.base import Entry, Key, TableTier
from kvlab.cache.tiers.registry import TIERS
from kvlab.integrity import require


@TIERS.register("host")
class HostTier(TableTier):
    describe = "host memory, LRU, bounded in blocks"

    def __init__(self, capacity_blocks: int):
        super().__init__(capacity_blocks)
        self.entries: OrderedDict[Key, tuple[str | None, StoredKV]] = OrderedDict()  # LRU first
        self._nbytes = 0
        self.held: dict[int, int] = {}  # swapped-out request id -> blocks it holds here

    @classmethod
    def from_config(cls, config) -> HostTier:
        return cls(config.host_blocks)

    def get(self, key: Key, salt: str | None) -> StoredKV | None:
        entry = self._lookup(key, salt)
        if entry is None:
            return None
        start = time.perf_counter()
        self.entries.move_to_end(key)
        self.stats.loads += 1
        self.stats.bytes_loaded += entry[1].nbytes
        self.stats.load_s += time.perf_counter() - start
        return entry[1]

    def put(self, key: Key, salt: str | None, stored: StoredKV) -> list[Entry]:
        if key in self.entries:
            self.entries.move_to_end(key)
            return []
        start = time.perf_counter()
        self.entries[key] = (salt, stored)
        self._nbytes += stored.nbytes
        self.stats.saves += 1
        self.stats.bytes_saved += stored.nbytes
        evicted = self._make_room()
        self.stats.save_s += time.perf_counter() - start
        return evicted

    def _make_room(self) -> list[Entry]:
        evicted = []
        while self.entries and len(self.entries) + sum(self.held.values()) > self.capacity_blocks:
            old, (old_salt, old_stored) = self.entries.popitem(last=False)
            self._nbytes -= old_stored.nbytes
            self.stats.evictions += 1
            evicted.append((old, old_salt, old_stored))
        return evicted

    def hold(self, owner: int, blocks: int) -> list[Entry]:
        """A swapped-out request's `blocks` take room here; returns the entries evicted."""
        self.held[owner] = blocks
        return self._make_room()

    def release(self, owner: int) -> None:
        """The request swapped back in (or ended): its room is free again."""
        self.held.pop(owner, None)

    def discard(self, key: Key) -> bool:
        entry = self.entries.pop(key, None)
        if entry is None:
            return False
        self._nbytes -= entry[1].nbytes
        self.stats.discards += 1
        return True

    def check_integrity(self) -> None:
        held = sum(self.held.values())
        require(
            not self.entries or len(self.entries) + held <= self.capacity_blocks,
            "host tier holds more than its capacity (cached entries + swapped requests)",
        )
        stored_bytes = sum(stored.nbytes for _, stored in self.entries.values())
        require(
            stored_bytes == self._nbytes,
            f"host tier counts {self._nbytes} bytes but holds {stored_bytes}",
        )
        require(
            all(
                t.device.type == "cpu" for _, s in self.entries.values() for t in s.tensors.values()
            ),
            "a host-tier entry is not in host memory",
        )
