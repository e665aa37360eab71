"""Fixed-size KV blocks: a free list and a reference count per block.

A block is `block_size` consecutive token slots of the pool. A sequence holds a list of
block ids (its block table); a block may be referenced by several tables once prefix
sharing arrives, so it returns to the free list only when its count drops to zero.
"""

from __future__ import annotations

from collections import deque


class OutOfBlocks(RuntimeError):
    """No free block is left; callers must check `num_free` first."""


class BlockAllocator:
    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks={num_blocks} must be > 0")
        self.num_blocks = num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))  # FIFO: oldest-freed first
        self.ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def allocate(self) -> int:
        """Take a free block (reference count 1)."""
        if not self.free_blocks:
            raise OutOfBlocks(f"all {self.num_blocks} blocks are in use")
        block = self.free_blocks.popleft()
        self.ref_counts[block] = 1
        return block

    def incref(self, block: int) -> None:
        if self.ref_counts[block] <= 0:
            raise ValueError(f"block {block} is free: it cannot gain a reference")
        self.ref_counts[block] += 1

    def decref(self, block: int) -> bool:
        """Drop one reference; return True if the block became free."""
        if self.ref_counts[block] <= 0:
            raise ValueError(f"block {block} has no reference to drop (double free?)")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_blocks.append(block)
            return True
        return False

    def check_integrity(self) -> None:
        free = set(self.free_blocks)
        assert len(free) == len(self.free_blocks), "a block is twice in the free list"
        assert all(self.ref_counts[b] == 0 for b in free), "a free block has references"
        assert all(c >= 0 for c in self.ref_counts), "a negative reference count"
        used = sum(1 for c in self.ref_counts if c > 0)
        assert used + len(free) == self.num_blocks, (
            f"free {len(free)} + used {used} != total {self.num_blocks}"
        )
