"""Reference solutions to the four labs (instructors: see notebooks/labs/INSTRUCTOR.md).

Each is what the exercise cell of notebooks/labs/<lab>.ipynb should become; the solved
copies in notebooks/labs/solutions/ hold exactly this code (a test keeps them in step),
and `pytest --nbval` runs those copies through the graders.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Callable

import torch

from kvlab.cache import OutOfBlocks
from kvlab.engine.sequence import Sequence


# --- lab 1: the block allocator -------------------------------------------------------------
class LabBlockAllocator:
    """Fixed-size KV blocks: a free list, reference counts and an LRU pool of cached blocks.

    Every block is always exactly one of: free, used (ref count > 0), cached (ref count 0,
    K/V kept for a later request with the same prefix).
    """

    def __init__(self, num_blocks: int, on_evict: Callable[[int], None] | None = None):
        self.num_blocks = num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))  # oldest-freed first
        self.cached: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self.ref_counts = [0] * num_blocks
        self.on_evict = on_evict  # tells the prefix index that a cached block is gone

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def num_cached(self) -> int:
        return len(self.cached)

    @property
    def num_available(self) -> int:
        return len(self.free_blocks) + len(self.cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free - self.num_cached

    def allocate(self) -> int:
        """A free block, else the least recently used cached one; its ref count becomes 1."""
        if self.free_blocks:
            block = self.free_blocks.popleft()
        elif self.cached:
            block, _ = self.cached.popitem(last=False)
            if self.on_evict:
                self.on_evict(block)
        else:
            raise OutOfBlocks(f"all {self.num_blocks} blocks are in use")
        self.ref_counts[block] = 1
        return block

    def incref(self, block: int) -> None:
        """One more block table points at `block` (a cached block comes back into use)."""
        if block in self.cached:
            del self.cached[block]
        elif self.ref_counts[block] <= 0:
            raise ValueError(f"block {block} is free: it cannot gain a reference")
        self.ref_counts[block] += 1

    def decref(self, block: int, keep_cached: bool = False) -> bool:
        """Drop one reference; at zero the block is cached (keep_cached) or freed.

        Returns True if the block became free.
        """
        if self.ref_counts[block] <= 0:
            raise ValueError(f"block {block} has no reference to drop (double free?)")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] > 0:
            return False
        if keep_cached:
            self.cached[block] = None  # the most recently used end
            return False
        self.free_blocks.append(block)
        return True

    def uncache(self, block: int) -> None:
        """A cached block lost its prefix-index entry: it becomes free."""
        del self.cached[block]
        self.free_blocks.append(block)

    def check_integrity(self) -> None:
        free, cached = set(self.free_blocks), set(self.cached)
        assert len(free) == len(self.free_blocks), "a block is twice in the free list"
        assert not free & cached, "a block is both free and cached"
        assert all(self.ref_counts[b] == 0 for b in free | cached), "a free block has references"
        assert all(c >= 0 for c in self.ref_counts), "a negative reference count"
        used = sum(1 for c in self.ref_counts if c > 0)
        assert used + len(free) + len(cached) == self.num_blocks, "blocks were lost"


# --- lab 2: the chained block hash ----------------------------------------------------------
def block_keys(tokens: list[int], block_size: int, salt: str | None) -> list[bytes]:
    """One key per *full* block: key_i = H(key_{i-1}, tokens of block i, salt)."""
    keys, parent = [], b""
    for start in range(0, len(tokens) - block_size + 1, block_size):
        digest = hashlib.blake2b(parent, digest_size=16)
        for token in tokens[start : start + block_size]:
            digest.update(token.to_bytes(8, "little", signed=True))  # fixed width: no ambiguity
        digest.update(b"salt:" + (salt or "").encode())
        parent = digest.digest()
        keys.append(parent)
    return keys


# --- lab 3: the int8 codec ------------------------------------------------------------------
def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, H, D) float -> int8 codes (T, H, D) and one scale per token per head (T, H)."""
    x = x.float()
    scale = x.abs().amax(dim=-1) / 127  # (T, H): the head's largest |x| maps to 127
    safe = torch.where(scale > 0, scale, 1.0)[..., None]  # an all-zero head: codes 0
    q = (x / safe).round().clamp(-127, 127)
    return q.to(torch.int8), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Codes (T, H, D) and scales (T, H) -> float32 (T, H, D)."""
    return q.float() * scale.float()[..., None]


# --- lab 4: the preemption victim -----------------------------------------------------------
def choose_victim(running: list[Sequence]) -> Sequence:
    """The running sequence to preempt: lowest priority, then the most recently admitted."""
    return max(running, key=lambda seq: (-seq.priority, seq.admit_order))
