"""Lab 1 grader: a block allocator with reference counts and an LRU pool of cached blocks.

The learner's class is driven by random operation sequences side by side with kvlab's own
`BlockAllocator` (kvlab/cache/allocator.py), the reference: after every call the two must
agree on every block's reference count, on the cached blocks (in LRU order) and on the
counters, and each call must return (or raise) what kvlab's does. Only where several
answers are right does the learner choose: `allocate()` may hand out any free block, and
kvlab's allocator is then given the same one. Then the class replaces the allocator inside
kvlab's PagedCache and serves random traffic with prefix sharing (kvlab/labs/sharing.py).
"""

from __future__ import annotations

import random

from kvlab.cache import BlockAllocator, HashPrefixIndex, OutOfBlocks, RadixPrefixIndex
from kvlab.labs import sharing
from kvlab.labs.grading import (
    SEED_STRIDE,
    Broken,
    Case,
    LabResult,
    Transcript,
    grade,
    search,
    where,
)

DISTINCT = "a block in use is never handed out again"
LAST_REF = "a block is freed only when its last reference is dropped"
DECREF_RESULT = "decref() returns True exactly when the block became free"
REF_COUNTS = "ref_counts[b] equals the number of references held on block b"
ONE_STATE = "every block is exactly one of free, used or cached"
CONSERVED = "num_free + num_used + num_cached == num_blocks (no block lost or counted twice)"
DOUBLE_FREE = "decref() of a block without references raises ValueError (a double free)"
INCREF_FREE = "incref() of a free block raises ValueError (its contents are garbage)"
OUT_OF_BLOCKS = "allocate() raises OutOfBlocks exactly when no block is free or cached"
FREE_FIRST = "a cached block is evicted only when no block is free"
LRU = "allocate() evicts the least recently used cached block"
LRU_ORDER = "allocator.cached lists the cached blocks least recently used first"
ON_EVICT = "on_evict(block) is called once for each evicted cached block, and only then"
BLOCK_IDS = "block ids are integers 0 .. num_blocks - 1"
NO_CRASH = "valid calls run without crashing"

BASIC = ("allocate", "allocate", "free")
SHARED = (*BASIC, "share", "double_free", "incref_free")
CACHED = (*SHARED, "cache", "cache", "revive", "uncache")


class _Reference:
    """kvlab's BlockAllocator, recording its on_evict calls: what every block should be."""

    def __init__(self, num_blocks: int):
        self.evicted: list[int] = []
        self.allocator = BlockAllocator(num_blocks, on_evict=self.evicted.append)
        self.num_blocks = num_blocks

    @property
    def refs(self) -> list[int]:
        return list(self.allocator.ref_counts)

    @property
    def free(self) -> list[int]:
        return sorted(self.allocator.free_blocks)

    @property
    def cached(self) -> list[int]:  # least recently used first
        return list(self.allocator.cached)

    def used(self) -> list[int]:
        return [b for b in range(self.num_blocks) if self.allocator.ref_counts[b] > 0]


def _cases(seed: int, count: int, ops: tuple[str, ...], max_ops: int) -> list[Case]:
    rng = random.Random(seed)
    return [
        Case(
            (rng.randint(1, 5),),
            tuple((rng.choice(ops), rng.randrange(1000)) for _ in range(rng.randint(1, max_ops))),
        )
        for _ in range(count)
    ]


def _smaller(params: tuple) -> list[tuple]:
    return [(n,) for n in range(1, params[0])]


def _pick(blocks, r: int) -> int | None:
    blocks = sorted(blocks)
    return blocks[r % len(blocks)] if blocks else None


def _run(cls: type, case: Case) -> None:
    (num_blocks,) = case.params
    t = Transcript()
    evicted: list[int] = []
    t.add("evicted = []")
    t.add(f"a = {cls.__name__}({num_blocks}, on_evict=evicted.append)")
    try:
        a = cls(num_blocks, on_evict=evicted.append)
    except NotImplementedError:
        raise
    except Exception as error:
        raise t.broken(NO_CRASH, f"{type(error).__name__}: {error}", "a new allocator") from None
    ref = _Reference(num_blocks)
    _compare(a, ref, t, "")
    for op, r in case.ops:
        try:
            done = _step(a, ref, op, r, t, evicted)
        except (Broken, NotImplementedError):
            raise
        except Exception as error:
            t.add(t.pending, note=f"raised {type(error).__name__}")
            raise t.broken(
                NO_CRASH,
                f"{type(error).__name__}: {error}{where(error)}",
                "no error: this call is valid",
            ) from None
        if done:
            _compare(a, ref, t, op)


def _allocate(a, ref: _Reference, t: Transcript, evicted: list[int]) -> None:
    """allocate() on both: the learner's block must be one kvlab's allocator could give."""
    t.pending = "a.allocate()"
    before, ref_before = len(evicted), len(ref.evicted)
    free, cached = ref.free, ref.cached
    try:
        block = a.allocate()
    except NotImplementedError:
        raise
    except Exception as error:
        if (free or cached) and not isinstance(error, OutOfBlocks):
            raise  # a crash on a valid call: _run reports it
        t.add("a.allocate()", note=f"raised {type(error).__name__}")
        if not free and not cached and not isinstance(error, OutOfBlocks):
            raise t.broken(
                OUT_OF_BLOCKS,
                f"{type(error).__name__}: {error}",
                "OutOfBlocks (from kvlab.cache import OutOfBlocks): every block is in use",
            ) from None
        if free or cached:
            raise t.broken(
                OUT_OF_BLOCKS,
                f"OutOfBlocks, though {len(free)} block(s) are free and {len(cached)} cached",
                "a free block, else the least recently used cached one",
                "a block that was never put back on the free list is lost for good",
            ) from None
        return  # OutOfBlocks, as kvlab's allocator raises when every block is in use
    t.add("a.allocate()", block)
    if not free and not cached:
        raise t.broken(
            OUT_OF_BLOCKS,
            f"allocate() returned block {block} while every block is in use",
            "OutOfBlocks (from kvlab.cache import OutOfBlocks)",
        )
    if not isinstance(block, int) or not 0 <= block < ref.num_blocks:
        raise t.broken(BLOCK_IDS, f"allocate() returned {block!r}", f"0..{ref.num_blocks - 1}")
    if ref.allocator.ref_counts[block] > 0:
        raise t.broken(
            DISTINCT,
            f"allocate() returned block {block}, which still has "
            f"{ref.allocator.ref_counts[block]} reference(s)",
            f"one of the free blocks {free}"
            if free
            else f"the least recently used cached block {cached[0]}",
            "two sequences would now write their K/V into the same block",
        )
    if free and block in cached:
        raise t.broken(
            FREE_FIRST,
            f"allocate() evicted cached block {block} while blocks {free} were free",
            "a free block: a cached block holds K/V a later request may reuse",
        )
    if block in ref.allocator.free_blocks:  # any free block is right: kvlab's takes it too
        ref.allocator.free_blocks.remove(block)
        ref.allocator.free_blocks.appendleft(block)
    want = ref.allocator.allocate()
    if want != block:
        raise t.broken(
            LRU,
            f"allocate() evicted block {block}",
            f"block {want}: cached blocks, least recently used first, are {cached}",
            "an OrderedDict keeps insertion order: popitem(last=False) takes the oldest",
        )
    got_evictions, want_evictions = evicted[before:], ref.evicted[ref_before:]
    if got_evictions != want_evictions:
        raise t.broken(
            ON_EVICT,
            f"on_evict calls during this allocate(): {got_evictions}",
            f"exactly one call, on_evict({block}), so the prefix index forgets the block's "
            "old contents"
            if want_evictions
            else "no on_evict call: a free block was handed out, nothing was evicted",
        )


def _must_raise(a, ref: _Reference, op: str, r: int, t: Transcript) -> bool:
    """A double free, or incref() of a free block: kvlab's allocator raises ValueError."""
    if op == "double_free":
        pool = [b for b in range(ref.num_blocks) if ref.allocator.ref_counts[b] == 0]
    else:
        pool = ref.free
    block = _pick(pool, r)
    if block is None:
        return False
    call = f"a.decref({block})" if op == "double_free" else f"a.incref({block})"
    try:  # kvlab's allocator checks before it changes anything
        ref.allocator.decref(block) if op == "double_free" else ref.allocator.incref(block)
    except ValueError as error:
        kvlab_says = str(error)
    else:
        raise AssertionError(f"kvlab's BlockAllocator accepted {call}")
    try:
        result = a.decref(block) if op == "double_free" else a.incref(block)
    except ValueError:
        t.add(call, note="raised ValueError, as it should")
        return True
    except NotImplementedError:
        raise
    except Exception as error:
        result = error
    if isinstance(result, Exception):
        t.add(call, note=f"raised {type(result).__name__}")
        got = f"{call} raised {type(result).__name__}"
    else:
        t.add(call, result)
        got = f"{call} returned {result!r}"
    expected = f"ValueError, as kvlab's BlockAllocator raises: {kvlab_says}"
    if op == "double_free":
        raise t.broken(
            DOUBLE_FREE,
            got,
            expected,
            "a double free left unnoticed lets two sequences share a block later",
        )
    raise t.broken(INCREF_FREE, got, expected, "only used or cached blocks can gain a reference")


def _step(a, ref: _Reference, op: str, r: int, t: Transcript, evicted: list[int]) -> bool:
    """Apply one operation to the learner's allocator and kvlab's; False if it did not apply."""
    if op == "allocate":
        _allocate(a, ref, t, evicted)
        return True

    if op in ("free", "cache"):
        block = _pick(ref.used(), r)
        if block is None:
            return False
        keep = op == "cache"
        code = f"a.decref({block}, keep_cached=True)" if keep else f"a.decref({block})"
        t.pending = code
        result = a.decref(block, keep_cached=True) if keep else a.decref(block)
        t.add(code, result)
        want = ref.allocator.decref(block, keep_cached=keep)
        left = ref.allocator.ref_counts[block]
        if left and result is not False:
            raise t.broken(
                LAST_REF,
                f"decref({block}) returned {result!r}",
                f"False: block {block} still has {left} reference(s), so it stays in use",
                "decrement the count, and free the block only when it reaches 0",
            )
        if result is not want:
            raise t.broken(
                DECREF_RESULT,
                f"decref({block}{', keep_cached=True' if keep else ''}) returned {result!r}",
                f"{want}: the last reference is gone and the block is now "
                f"{'cached (not free)' if keep else 'free'}",
            )
        return True

    if op in ("share", "revive"):
        block = _pick(ref.used() if op == "share" else ref.cached, r)
        if block is None:
            return False
        t.pending = f"a.incref({block})"
        a.incref(block)
        note = (
            "a second block table shares the block"
            if op == "share"
            else ("a new request reuses the cached block")
        )
        t.add(f"a.incref({block})", note=note)
        ref.allocator.incref(block)
        return True

    if op == "uncache":
        block = _pick(ref.cached, r)
        if block is None:
            return False
        t.pending = f"a.uncache({block})"
        a.uncache(block)
        t.add(f"a.uncache({block})", note="its prefix-index entry is gone")
        ref.allocator.uncache(block)
        return True

    if op in ("double_free", "incref_free"):
        return _must_raise(a, ref, op, r, t)
    raise ValueError(f"unknown operation {op!r}")


def _compare(a, ref: _Reference, t: Transcript, last_op: str) -> None:
    """The learner's allocator holds what kvlab's holds, as seen through the interface."""
    refs, want_refs = list(a.ref_counts), ref.refs
    if refs != want_refs:
        b = next(i for i, (x, y) in enumerate(zip(refs, want_refs)) if x != y)
        raise t.broken(
            REF_COUNTS,
            f"a.ref_counts == {refs}",
            f"{want_refs} (block {b} should have {want_refs[b]})",
        )
    cached, want_cached = list(a.cached), ref.cached
    if set(cached) != set(want_cached):
        hints = {
            "revive": "incref() of a cached block must take it out of `cached`",
            "uncache": "uncache() moves the block from `cached` to the free list",
            "cache": "decref(b, keep_cached=True) at the last reference puts b into `cached`",
            "allocate": "an evicted block must leave `cached`",
        }
        raise t.broken(
            ONE_STATE, f"list(a.cached) == {cached}", f"{want_cached}", hints.get(last_op, "")
        )
    k = ref.allocator
    counts = (a.num_free, a.num_used, a.num_cached, a.num_available)
    want = (k.num_free, k.num_used, k.num_cached, k.num_available)
    if counts != want:
        raise t.broken(
            CONSERVED,
            "num_free={}, num_used={}, num_cached={}, num_available={}".format(*counts),
            "num_free={}, num_used={}, num_cached={}, num_available={}".format(*want)
            + f" (of {ref.num_blocks} blocks)",
            {
                "uncache": "uncache() must put the block on the free list",
                "free": "a block whose last reference is dropped goes back on the free list, once",
                "cache": "a block cached by decref(..., keep_cached=True) is counted as cached",
                "allocate": "allocate() takes its block off the free list (or out of `cached`)",
            }.get(last_op, ""),
        )
    if cached != want_cached:
        raise t.broken(
            LRU_ORDER,
            f"list(a.cached) == {cached}",
            f"{want_cached}",
            "a block cached by decref(..., keep_cached=True) goes to the most recently "
            "used end: self.cached[block] = None",
        )


def _index(kind: str):
    return {"hash": HashPrefixIndex, "radix": RadixPrefixIndex}[kind]


def check_block_allocator(
    cls: type, verbose: bool = True, raise_on_failure: bool = False, seed: int = 0
) -> LabResult:
    """Grade a block allocator class (the interface of notebooks/labs/01_block_allocator).

    Checks, each on seeded random operation sequences (a failure is shrunk to the
    smallest sequence that still breaks the same invariant):

    1. allocate and free;  2. shared blocks (reference counts, double frees);
    3. cached blocks (keep_cached, reuse, uncache, LRU eviction, on_evict);
    4. inside kvlab's PagedCache, with hash and radix prefix sharing.

    `seed` (default 0, the cases the notebook shows) draws other random cases for the same
    checks: the lab sources' hidden tests grade with a seed the learner has not seen.
    """

    def ops_check(base: int, count: int, ops: tuple[str, ...], max_ops: int):
        cases = _cases(base + SEED_STRIDE * seed, count, ops, max_ops)
        return lambda: search(cases, lambda c: _run(cls, c), _smaller)

    def paged_check(kind: str):
        def check():
            search(
                sharing.random_cases(seed=len(kind) + SEED_STRIDE * seed, count=30),
                lambda case: sharing.run_sharing_case(
                    case,
                    _index(kind),
                    lambda cache: cls(cache.num_blocks, on_evict=cache.allocator.on_evict),
                ),
                sharing.smaller_params,
            )

        return check

    checks = [
        ("allocate and free", ops_check(1, 60, BASIC, 20)),
        ("shared blocks: reference counts", ops_check(2, 100, SHARED, 30)),
        ("cached blocks: reuse and LRU eviction", ops_check(3, 200, CACHED, 40)),
        ("inside PagedCache with hash prefix caching", paged_check("hash")),
        ("inside PagedCache with radix prefix caching", paged_check("radix")),
    ]
    return grade("Block allocator", checks, verbose, raise_on_failure)
