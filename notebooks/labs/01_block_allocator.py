# ---
# jupyter:
#   jupytext:
#     cell_metadata_filter: nbgrader,tags,-all
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Lab 1 · The block allocator
#
# A paged KV cache cuts its memory into fixed-size **blocks** of token slots and hands them
# out one at a time. The part that hands them out is the **block allocator** (vLLM's
# `BlockPool`, nano-vllm's `BlockManager`). With prefix caching it has three jobs:
#
# * **a free list**: blocks nobody uses; `allocate()` takes one;
# * **reference counts**: requests that share a prompt prefix point their block tables at
#   the *same* block, so a block goes back only when its **last** reference is dropped;
# * **cached blocks**: a block whose last reference is dropped but whose K/V the prefix
#   index still knows is not wiped. It waits in an LRU pool: a later request with the same
#   prefix takes it back with `incref()` (no recompute), and when no free block is left,
#   `allocate()` **evicts** the least recently used one and tells the index (`on_evict`).
#
# Every block is always exactly one of **free**, **used** (ref count > 0) or **cached**.
# In this lab you write the four methods that keep it so; the grader then drives your class
# with random operations, and finally runs it *inside kvlab's real `PagedCache`* with hash
# and radix prefix sharing.
#
# Run the set-up cell, fill in the TODOs, run the "try it" cell, then the grader and the
# check cells after it.

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
from collections import OrderedDict, deque
from collections.abc import Callable

from kvlab.cache import OutOfBlocks  # noqa: F401 (allocate() raises it)
from kvlab.labs import check_block_allocator

# %% [markdown]
# ## The exercise
#
# `__init__`, the counters and `check_integrity()` are given. Write `allocate`, `incref`,
# `decref` and `uncache`. The data structures:
#
# * `free_blocks`: a `deque`; take from the left (`popleft()`), give back on the right;
# * `cached`: an `OrderedDict` used as an LRU list: `cached[b] = None` adds `b` at the
#   most recently used end, `popitem(last=False)` removes the least recently used one;
# * `ref_counts[b]`: how many block tables point at block `b`.


# %% nbgrader={"grade": false, "grade_id": "exercise", "locked": false, "schema_version": 3, "solution": true, "task": false}
# EXERCISE: fill in every TODO, then run this cell.
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
        # TODO: take the block at the front of self.free_blocks. If none is free, evict the
        #       least recently used cached block (and call self.on_evict(block) if it is
        #       set). If there is neither, raise OutOfBlocks. Its ref count becomes 1.
        raise NotImplementedError

    def incref(self, block: int) -> None:
        """One more block table points at `block` (a cached block comes back into use)."""
        # TODO: a cached block leaves self.cached; a free block raises ValueError (its
        #       contents are garbage); then add one reference.
        raise NotImplementedError

    def decref(self, block: int, keep_cached: bool = False) -> bool:
        """Drop one reference; at zero the block is cached (keep_cached) or freed.

        Returns True if the block became free.
        """
        # TODO: a block without references raises ValueError (a double free). At zero
        #       references: keep_cached puts it at the most recently used end of
        #       self.cached (return False); otherwise it goes back on the free list (True).
        raise NotImplementedError

    def uncache(self, block: int) -> None:
        """A cached block lost its prefix-index entry: it becomes free."""
        # TODO
        raise NotImplementedError

    def check_integrity(self) -> None:
        free, cached = set(self.free_blocks), set(self.cached)
        assert len(free) == len(self.free_blocks), "a block is twice in the free list"
        assert not free & cached, "a block is both free and cached"
        assert all(self.ref_counts[b] == 0 for b in free | cached), "a free block has references"
        assert all(c >= 0 for c in self.ref_counts), "a negative reference count"
        used = sum(1 for c in self.ref_counts if c > 0)
        assert used + len(free) + len(cached) == self.num_blocks, "blocks were lost"


# %% [markdown]
# ## Try it

# %% tags=["raises-exception"]
allocator = LabBlockAllocator(4)
a, b = allocator.allocate(), allocator.allocate()
allocator.incref(a)  # a second request shares block a (a common prompt prefix)
print("blocks", a, b, "| ref counts", allocator.ref_counts)
print("decref(a) twice:", allocator.decref(a), allocator.decref(a), "(True: now free)")
allocator.decref(b, keep_cached=True)  # b's K/V stay for a later request
print("free", allocator.num_free, "| cached", allocator.num_cached, "| used", allocator.num_used)
allocator.check_integrity()

# %% [markdown]
# ## Grade it
#
# The grader prints one line when every check passes; otherwise the first broken
# rule, the smallest input that breaks it, and what was expected.

# %% nbgrader={"grade": false, "grade_id": "grader", "locked": true, "schema_version": 3, "solution": false, "task": false}
result = check_block_allocator(LabBlockAllocator)

# %% [markdown]
# ## The checks, one cell each
#
# Each cell below passes if the grader's check of that name passed; if not, it raises
# `LabFailure` with that check's report (the broken invariant, the smallest failing input,
# what was expected). Under nbgrader each of these cells is autograded and worth the points
# it names, so a partly right answer gets partial marks; the cells are locked. When your lab
# is graded, each cell also runs its check on random cases this notebook does not show
# (hidden tests): code that passes only the cases shown here loses those points.

# %% nbgrader={"grade": true, "grade_id": "check_allocate_and_free", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 2 points: the check "allocate and free".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("allocate and free")

# %% nbgrader={"grade": true, "grade_id": "check_shared_blocks_reference_counts", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 3 points: the check "shared blocks: reference counts".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("shared blocks: reference counts")

# %% nbgrader={"grade": true, "grade_id": "check_cached_blocks_reuse_and_lru_eviction", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 3 points: the check "cached blocks: reuse and LRU eviction".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("cached blocks: reuse and LRU eviction")

# %% nbgrader={"grade": true, "grade_id": "check_inside_pagedcache_with_hash_prefix_caching", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 1 point: the check "inside PagedCache with hash prefix caching".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("inside PagedCache with hash prefix caching")

# %% nbgrader={"grade": true, "grade_id": "check_inside_pagedcache_with_radix_prefix_caching", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 1 point: the check "inside PagedCache with radix prefix caching".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("inside PagedCache with radix prefix caching")

# %% [markdown]
# ## What the grader checks
#
# 1. **allocate and free**, 2. **shared blocks**, 3. **cached blocks**: seeded random
#    sequences of calls, made on your class and on kvlab's own `BlockAllocator` side by
#    side; after every call both must hold the same reference counts, cached blocks (in LRU
#    order) and counters, and each call must return (or raise) what kvlab's does. Where any
#    free block is a right answer, kvlab's allocator takes the one yours took. A
#    failure is shrunk to the shortest sequence of calls that still breaks the same rule and
#    printed as code you can paste into a cell.
# 4. and 5. **inside PagedCache**: your class replaces the allocator of kvlab's paged cache,
#    which admits, grows and finishes requests that share prefixes (the property test of
#    `tests/test_prefix_cache.py`). After every step `PagedCache.check_integrity()` must
#    hold and each request must read back exactly the K/V it wrote.
#
# ## What to try next
#
# * Compare with the library's `kvlab/cache/allocator.py`, and with vLLM v1's
#   `BlockPool`: there, free and cached blocks share **one** LRU queue, and a block's
#   prefix hash is dropped only when the queue hands the block out again.
# * Why take free blocks before cached ones, even though the free list is FIFO?
# * Make `allocate()` prefer cached blocks and run the grader: which checks still pass?
#   (Correctness survives; what is lost is cache hits.)
