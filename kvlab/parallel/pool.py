"""DistributedPool: rank 0's KV pool, mirroring every operation the cache asks of it.

The cache on rank 0 decides which slots hold which tokens; each rank stores its own KV
heads of those slots. Writes and reads happen inside the forward on every rank; the other
operations a cache performs (block copies for copy-on-write and partial prefix hits,
swap-out and swap-in, poisoning, rolling back drafts) are sent to the workers first, so
all ranks' pools stay slot for slot the same.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvlab.cache.codecs import StoredKV
from kvlab.cache.pool import KVPool


class ShardedKV:
    """A swapped-out sequence's stored K/V: one StoredKV per rank (its KV heads)."""

    def __init__(self, parts: list[StoredKV]):
        self.parts = parts

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)


class DistributedPool:
    """Looks like a KVPool to the cache; `local` is this rank's own."""

    def __init__(self, local: KVPool, send: Callable, gather: Callable):
        self.local, self._send, self._gather = local, send, gather

    def __getattr__(self, name: str):
        return getattr(self.local, name)  # spec, num_slots, codec, bytes_per_token, ...

    def copy(self, source: torch.Tensor, target: torch.Tensor) -> None:
        self._send(("copy", source, target))
        self.local.copy(source, target)

    def read(self, slots: torch.Tensor) -> ShardedKV:
        self._send(("read", slots))
        return ShardedKV(self._gather(self.local.read(slots)))

    def restore(self, slots: torch.Tensor, saved: ShardedKV) -> None:
        self._send(("restore", slots, saved.parts))
        self.local.restore(slots, saved.parts[0])

    def poison(self, slots: torch.Tensor) -> None:
        self._send(("poison", slots))
        self.local.poison(slots)

    def discard(self, slots: torch.Tensor) -> None:
        self._send(("discard", slots))
        self.local.discard(slots)
