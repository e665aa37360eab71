"""The one interface every KV-cache variant implements, and the memory accounting they share.

Every variant hands each sequence a *block table*: a list of physical block ids, each
block holding `block_size` consecutive token slots of the shared KVPool. Token position p
of a sequence lives in slot `table[p // block_size] * block_size + p % block_size`.
The naive cache is the special case of one block of `max_model_len` slots per sequence.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from kvlab.cache.codecs import StoredKV
from kvlab.cache.pool import KVPool
from kvlab.sequence import Sequence


@dataclass(frozen=True)
class MemoryStats:
    """KV memory as every variant reports it, so side-by-side plots are fair."""

    budget_bytes: int  # the whole pool
    reserved_bytes: int  # slots set aside for running sequences
    live_bytes: int  # slots that hold a token's K/V right now

    @property
    def waste_bytes(self) -> int:
        return self.reserved_bytes - self.live_bytes

    @property
    def waste_frac(self) -> float:
        return self.waste_bytes / self.reserved_bytes if self.reserved_bytes else 0.0


class KVCache(ABC):
    """Decides which slots of the pool belong to which sequence."""

    name: str

    def __init__(self, pool: KVPool, block_size: int, max_model_len: int, poison_freed: bool):
        if pool.num_slots % block_size:
            raise ValueError(f"pool of {pool.num_slots} slots is not a multiple of {block_size=}")
        self.pool = pool
        self.block_size = block_size
        self.num_blocks = pool.num_slots // block_size
        self.max_model_len = max_model_len
        self.poison_freed = poison_freed
        self.sequences: dict[int, Sequence] = {}  # admitted, by request id

    # --- what each variant decides -------------------------------------------------
    @abstractmethod
    def can_admit(self, seq: Sequence, alone: bool = False) -> bool:
        """Whether `seq` can be admitted now without endangering running sequences.

        `alone`: no sequence is running (headroom kept for running ones is not needed)."""

    @abstractmethod
    def _allocate(self, seq: Sequence, alone: bool) -> None:
        """Reserve what this variant reserves at admission."""

    @abstractmethod
    def ensure_capacity(self, seq: Sequence, num_tokens: int) -> None:
        """Make positions [0, num_tokens) of `seq` writable."""

    @abstractmethod
    def _release(self, seq: Sequence) -> list[int]:
        """Give back the sequence's blocks; return those that became free."""

    @abstractmethod
    def block_table(self, seq: Sequence) -> list[int]:
        """Physical block ids holding the sequence's tokens, in logical order."""

    @abstractmethod
    def reserved_slots(self) -> int:
        """Token slots set aside for admitted sequences."""

    @property
    @abstractmethod
    def num_available(self) -> int:
        """Blocks an allocation can take now (free ones, and evictable cached ones)."""

    @abstractmethod
    def block_owners(self) -> list[int]:
        """For each physical block, the request id holding it, or -1 (for block maps)."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Raise IntegrityError naming the broken invariant, if any."""

    @abstractmethod
    def publish(self, seq: Sequence) -> None:
        """`seq`'s prompt is in the cache: let later requests reuse it (if this cache can)."""

    @abstractmethod
    def check_fits(self, seq: Sequence) -> None:
        """Raise ValueError if `seq` could never be served within this cache's budget."""

    # --- preemption (caches that never over-admit need none of it) -----------------
    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks `seq` must take to hold `num_tokens` tokens (0: it has room)."""
        return 0

    def swap_out(self, seq: Sequence) -> StoredKV:
        """Copy `seq`'s KV to host memory and free its blocks; return the copy."""
        raise NotImplementedError(f"the {self.name} cache does not swap")

    def can_swap_in(self, seq: Sequence, alone: bool = False) -> bool:
        raise NotImplementedError(f"the {self.name} cache does not swap")

    def swap_in(self, seq: Sequence, saved: StoredKV) -> None:
        """Re-admit a swapped-out `seq` into fresh blocks holding its saved KV."""
        raise NotImplementedError(f"the {self.name} cache does not swap")

    # --- shared behaviour ----------------------------------------------------------
    def admit(self, seq: Sequence, alone: bool = False) -> None:
        """Give `seq` what it needs to start (after `can_admit(seq, alone)` said yes)."""
        if seq.request_id in self.sequences:
            raise ValueError(f"request {seq.request_id} is already admitted")
        self._allocate(seq, alone)
        self.sequences[seq.request_id] = seq

    def free(self, seq: Sequence) -> None:
        """Release everything `seq` holds (idempotent for sequences never admitted)."""
        if self.sequences.pop(seq.request_id, None) is None:
            return
        freed = self._release(seq)
        if self.poison_freed and freed:
            self.pool.poison(self.block_slots(freed))

    def block_slots(self, blocks: list[int]) -> torch.Tensor:
        """All slots of the given blocks, (len(blocks) * block_size,) int64."""
        ids = torch.tensor(blocks, dtype=torch.long, device=self.pool.device)
        offsets = torch.arange(self.block_size, device=self.pool.device)
        return (ids[:, None] * self.block_size + offsets).reshape(-1)

    def live_tokens(self) -> int:
        return sum(seq.num_computed for seq in self.sequences.values())

    def memory(self) -> MemoryStats:
        per_token = self.pool.bytes_per_token
        return MemoryStats(
            budget_bytes=self.pool.num_slots * per_token,
            reserved_bytes=self.reserved_slots() * per_token,
            live_bytes=self.live_tokens() * per_token,
        )

    @property
    def num_running(self) -> int:
        return len(self.sequences)
