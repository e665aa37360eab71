"""The naive cache: one contiguous buffer of max_model_len slots per sequence.

This is what early serving systems did (and what `past_key_values` tensors of a fixed
batch do): reserve the worst case at admission. A 40-token answer to a 100-token prompt
still holds max_model_len slots; the difference is waste.
"""

from __future__ import annotations

from kvlab.cache.base import KVCache
from kvlab.cache.pool import KVPool
from kvlab.cache.registry import CACHES
from kvlab.integrity import require
from kvlab.sequence import Sequence


@CACHES.register("naive")
class NaiveCache(KVCache):
    """Contiguous per-sequence regions; region i covers slots [i*L, (i+1)*L)."""

    def __init__(self, pool: KVPool, max_model_len: int, poison_freed: bool = False):
        num_regions = pool.num_slots // max_model_len
        if num_regions == 0:
            raise ValueError(
                f"KV budget of {pool.num_slots} token slots is smaller than one naive "
                f"sequence (max_model_len={max_model_len}); raise the budget or lower "
                "max_model_len"
            )
        super().__init__(pool, max_model_len, max_model_len, poison_freed)
        self.free_regions = list(range(num_regions - 1, -1, -1))  # a stack: pop() gives 0 first
        self.region_of: dict[int, int] = {}  # request id -> region

    @classmethod
    def slot_unit(cls, config, max_model_len: int) -> tuple[str, int]:
        return "max_model_len", max_model_len

    @classmethod
    def from_config(cls, config, pool: KVPool, max_model_len: int) -> NaiveCache:
        return cls(pool, max_model_len, config.poison_freed)

    def check_fits(self, seq: Sequence) -> None:
        """Nothing to check: a region holds max_model_len tokens, where the engine stops."""

    def _plan(self, seq: Sequence, alone: bool, chunk: int | None) -> int | None:
        """The free region `seq` takes (the lowest), or None."""
        return self.free_regions[-1] if self.free_regions else None

    def _allocate(self, seq: Sequence, plan: int, chunk: int | None) -> None:
        self.region_of[seq.request_id] = self.free_regions.pop()

    def ensure_capacity(self, seq: Sequence, num_tokens: int) -> None:
        if num_tokens > self.max_model_len:
            raise ValueError(f"{num_tokens} tokens exceed max_model_len={self.max_model_len}")

    def _release(self, seq: Sequence) -> list[int]:
        region = self.region_of.pop(seq.request_id)
        self.free_regions.append(region)
        return [region]

    def block_table(self, seq: Sequence) -> list[int]:
        return [self.region_of[seq.request_id]]

    def reserved_slots(self) -> int:
        return len(self.region_of) * self.max_model_len

    @property
    def num_available(self) -> int:
        return len(self.free_regions)

    def block_owners(self) -> list[int]:
        owners = [-1] * self.num_blocks
        for request_id, region in self.region_of.items():
            owners[region] = request_id
        return owners

    def check_integrity(self) -> None:
        used = list(self.region_of.values())
        total = self.num_blocks
        require(len(set(used)) == len(used), f"a region is owned twice: {sorted(used)}")
        require(not set(used) & set(self.free_regions), "a region is both used and free")
        require(
            len(used) + len(self.free_regions) == total,
            f"free {len(self.free_regions)} + used {len(used)} != total {total}",
        )
        require(set(self.region_of) == set(self.sequences), "region owners != admitted sequences")
