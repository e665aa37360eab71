"""Fixed-size KV blocks: a free list, reference counts, and an LRU pool of cached blocks.

A block is `block_size` consecutive token slots of the pool. A sequence holds a list of
block ids (its block table); with prefix sharing several tables may point at one block,
so a block is released only when its reference count drops to zero. A released block
whose contents are indexed by a prefix cache is *cached*: it keeps its K/V so a later
request with the same prefix can reuse it, and it is evicted (least recently used first)
only when the free list is empty. Every block is always exactly one of: free, used
(referenced), cached (unreferenced, reusable).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable

from kvlab.integrity import require


class OutOfBlocks(RuntimeError):
    """No free or evictable block is left; callers must check `num_available` first."""


class BlockAllocator:
    def __init__(self, num_blocks: int, on_evict: Callable[[int], None] | None = None):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks={num_blocks} must be > 0")
        self.num_blocks = num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))  # FIFO: oldest-freed first
        self.cached: OrderedDict[int, None] = OrderedDict()  # unreferenced, LRU first
        self.ref_counts = [0] * num_blocks
        self.on_evict = on_evict  # tells the prefix index that a cached block is gone
        self.evictions = 0

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def num_cached(self) -> int:
        return len(self.cached)

    @property
    def num_available(self) -> int:
        """Blocks an allocation can take: free ones, then evicted cached ones."""
        return len(self.free_blocks) + len(self.cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free - self.num_cached

    def allocate(self) -> int:
        """Take a free block, else evict the least recently used cached one (count 1)."""
        if self.free_blocks:
            block = self.free_blocks.popleft()
        elif self.cached:
            block, _ = self.cached.popitem(last=False)
            self.evictions += 1
            if self.on_evict:
                self.on_evict(block)
        else:
            raise OutOfBlocks(f"all {self.num_blocks} blocks are in use")
        self.ref_counts[block] = 1
        return block

    def incref(self, block: int) -> None:
        """Add a reference; a cached block comes back into use (no copy, no recompute)."""
        if block in self.cached:
            del self.cached[block]
        elif self.ref_counts[block] <= 0:
            raise ValueError(f"block {block} is free: it cannot gain a reference")
        self.ref_counts[block] += 1

    def decref(self, block: int, keep_cached: bool = False) -> bool:
        """Drop one reference; at zero the block becomes cached (if `keep_cached`) or free.

        Returns True if the block became free (its contents are garbage from now on).
        """
        if self.ref_counts[block] <= 0:
            raise ValueError(f"block {block} has no reference to drop (double free?)")
        self.ref_counts[block] -= 1
        if self.ref_counts[block]:
            return False
        if keep_cached:
            self.cached[block] = None  # most recently used end
            return False
        self.free_blocks.append(block)
        return True

    def uncache(self, block: int) -> None:
        """A cached block lost its index entry: move it to the free list."""
        del self.cached[block]
        self.free_blocks.append(block)

    def check_integrity(self) -> None:
        free, cached = set(self.free_blocks), set(self.cached)
        require(len(free) == len(self.free_blocks), "a block is twice in the free list")
        require(not free & cached, "a block is both free and cached")
        require(all(self.ref_counts[b] == 0 for b in free | cached), "a free block has references")
        require(all(c >= 0 for c in self.ref_counts), "a negative reference count")
        used = sum(1 for c in self.ref_counts if c > 0)
        require(
            used + len(free) + len(cached) == self.num_blocks,
            f"free {len(free)} + used {used} + cached {len(cached)} != total {self.num_blocks}",
        )
