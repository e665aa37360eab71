"""Lab 1 grader: a block allocator with reference counts and an LRU pool of cached blocks.

The learner's class is driven by random operation sequences next to a small model of
what every block should be (free, used with n references, cached in LRU order); after
every call the two must agree. Then the class replaces the allocator inside kvlab's
PagedCache and serves random traffic with prefix sharing (kvlab/labs/sharing.py).
"""

from __future__ import annotations

import random
from collections import OrderedDict

from kvlab.cache import HashPrefixIndex, OutOfBlocks, RadixPrefixIndex
from kvlab.labs import sharing
from kvlab.labs.grading import Broken, Case, LabResult, Transcript, grade, search, where

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


class _Model:
    """What the allocator should hold: reference counts, free set, cached blocks (LRU first)."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.refs = [0] * num_blocks
        self.free = set(range(num_blocks))
        self.cached: OrderedDict[int, None] = OrderedDict()

    def used(self) -> list[int]:
        return [b for b in range(self.num_blocks) if self.refs[b] > 0]


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
    m = _Model(num_blocks)
    _compare(a, m, t, "")
    for op, r in case.ops:
        try:
            done = _step(a, m, op, r, t, evicted)
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
            _compare(a, m, t, op)


def _step(a, m: _Model, op: str, r: int, t: Transcript, evicted: list[int]) -> bool:
    """Apply one operation to the allocator and the model; False if it did not apply."""
    if op == "allocate":
        t.pending = "a.allocate()"
        before = len(evicted)
        available = len(m.free) + len(m.cached)
        try:
            block = a.allocate()
        except NotImplementedError:
            raise
        except Exception as error:
            if available and not isinstance(error, OutOfBlocks):
                raise  # a crash on a valid call: _run reports it
            t.add("a.allocate()", note=f"raised {type(error).__name__}")
            if not available and not isinstance(error, OutOfBlocks):
                raise t.broken(
                    OUT_OF_BLOCKS,
                    f"{type(error).__name__}: {error}",
                    "OutOfBlocks (from kvlab.cache import OutOfBlocks): every block is in use",
                ) from None
            if available:
                raise t.broken(
                    OUT_OF_BLOCKS,
                    f"OutOfBlocks, though {len(m.free)} block(s) are free and "
                    f"{len(m.cached)} cached",
                    "a free block, else the least recently used cached one",
                    "a block that was never put back on the free list is lost for good",
                ) from None
            return True
        t.add("a.allocate()", block)
        if not available:
            raise t.broken(
                OUT_OF_BLOCKS,
                f"allocate() returned block {block} while every block is in use",
                "OutOfBlocks (from kvlab.cache import OutOfBlocks)",
            )
        if not isinstance(block, int) or not 0 <= block < m.num_blocks:
            raise t.broken(BLOCK_IDS, f"allocate() returned {block!r}", f"0..{m.num_blocks - 1}")
        if m.refs[block] > 0:
            raise t.broken(
                DISTINCT,
                f"allocate() returned block {block}, which still has {m.refs[block]} reference(s)",
                f"one of the free blocks {sorted(m.free)}"
                if m.free
                else f"the least recently used cached block {next(iter(m.cached))}",
                "two sequences would now write their K/V into the same block",
            )
        new_evictions = evicted[before:]
        if m.free:
            if block in m.cached:
                raise t.broken(
                    FREE_FIRST,
                    f"allocate() evicted cached block {block} while blocks {sorted(m.free)} "
                    "were free",
                    "a free block: a cached block holds K/V a later request may reuse",
                )
            if new_evictions:
                raise t.broken(
                    ON_EVICT,
                    f"on_evict was called with {new_evictions} for a free block",
                    "no on_evict call: nothing was evicted",
                )
            m.free.discard(block)
        else:
            lru = next(iter(m.cached))
            if block != lru:
                raise t.broken(
                    LRU,
                    f"allocate() evicted block {block}",
                    f"block {lru}: cached blocks, least recently used first, are {list(m.cached)}",
                    "an OrderedDict keeps insertion order: popitem(last=False) takes the oldest",
                )
            if new_evictions != [block]:
                raise t.broken(
                    ON_EVICT,
                    f"on_evict calls during this allocate(): {new_evictions}",
                    f"exactly one call, on_evict({block}), so the prefix index forgets the "
                    "block's old contents",
                )
            del m.cached[block]
        m.refs[block] = 1
        return True

    if op in ("free", "cache"):
        block = _pick(m.used(), r)
        if block is None:
            return False
        keep = op == "cache"
        code = f"a.decref({block}, keep_cached=True)" if keep else f"a.decref({block})"
        t.pending = code
        result = a.decref(block, keep_cached=True) if keep else a.decref(block)
        t.add(code, result)
        m.refs[block] -= 1
        left = m.refs[block]
        if left and result is not False:
            raise t.broken(
                LAST_REF,
                f"decref({block}) returned {result!r}",
                f"False: block {block} still has {left} reference(s), so it stays in use",
                "decrement the count, and free the block only when it reaches 0",
            )
        if not left and result is not (not keep):
            raise t.broken(
                DECREF_RESULT,
                f"decref({block}{', keep_cached=True' if keep else ''}) returned {result!r}",
                f"{not keep}: the last reference is gone and the block is now "
                f"{'cached (not free)' if keep else 'free'}",
            )
        if not left:
            if keep:
                m.cached[block] = None
            else:
                m.free.add(block)
        return True

    if op == "share":
        block = _pick(m.used(), r)
        if block is None:
            return False
        t.pending = f"a.incref({block})"
        a.incref(block)
        t.add(f"a.incref({block})", note="a second block table shares the block")
        m.refs[block] += 1
        return True

    if op == "revive":
        block = _pick(m.cached, r)
        if block is None:
            return False
        t.pending = f"a.incref({block})"
        a.incref(block)
        t.add(f"a.incref({block})", note="a new request reuses the cached block")
        del m.cached[block]
        m.refs[block] = 1
        return True

    if op == "uncache":
        block = _pick(m.cached, r)
        if block is None:
            return False
        t.pending = f"a.uncache({block})"
        a.uncache(block)
        t.add(f"a.uncache({block})", note="its prefix-index entry is gone")
        del m.cached[block]
        m.free.add(block)
        return True

    if op in ("double_free", "incref_free"):
        pool = [b for b in range(m.num_blocks) if m.refs[b] == 0]
        if op == "incref_free":
            pool = sorted(m.free)
        block = _pick(pool, r)
        if block is None:
            return False
        call = f"a.decref({block})" if op == "double_free" else f"a.incref({block})"
        try:
            result = a.decref(block) if op == "double_free" else a.incref(block)
        except ValueError:
            t.add(call, note="raised ValueError, as it should")
            return True
        except Exception as error:
            result = error
        if isinstance(result, Exception):
            t.add(call, note=f"raised {type(result).__name__}")
        else:
            t.add(call, result)
        got = (
            f"{call} raised {type(result).__name__}"
            if isinstance(result, Exception)
            else f"{call} returned {result!r}"
        )
        state = "cached" if block in m.cached else "free"
        if op == "double_free":
            raise t.broken(
                DOUBLE_FREE,
                got,
                f"ValueError: block {block} is {state} and has no reference to drop",
                "a double free left unnoticed lets two sequences share a block later",
            )
        raise t.broken(
            INCREF_FREE,
            got,
            f"ValueError: block {block} is free; only used or cached blocks can gain a reference",
        )
    raise ValueError(f"unknown operation {op!r}")


def _compare(a, m: _Model, t: Transcript, last_op: str) -> None:
    refs = list(a.ref_counts)
    if refs != m.refs:
        b = next(i for i, (x, y) in enumerate(zip(refs, m.refs)) if x != y)
        raise t.broken(
            REF_COUNTS, f"a.ref_counts == {refs}", f"{m.refs} (block {b} should have {m.refs[b]})"
        )
    cached = list(a.cached)
    if set(cached) != set(m.cached):
        hints = {
            "revive": "incref() of a cached block must take it out of `cached`",
            "uncache": "uncache() moves the block from `cached` to the free list",
            "cache": "decref(b, keep_cached=True) at the last reference puts b into `cached`",
            "allocate": "an evicted block must leave `cached`",
        }
        raise t.broken(
            ONE_STATE, f"list(a.cached) == {cached}", f"{list(m.cached)}", hints.get(last_op, "")
        )
    counts = (a.num_free, a.num_used, a.num_cached)
    want = (len(m.free), len(m.used()), len(m.cached))
    if counts != want or a.num_available != want[0] + want[2]:
        raise t.broken(
            CONSERVED,
            f"num_free={counts[0]}, num_used={counts[1]}, num_cached={counts[2]}, "
            f"num_available={a.num_available}",
            f"num_free={want[0]}, num_used={want[1]}, num_cached={want[2]}, "
            f"num_available={want[0] + want[2]} (of {m.num_blocks} blocks)",
            {
                "uncache": "uncache() must put the block on the free list",
                "free": "a block whose last reference is dropped goes back on the free list, once",
                "cache": "a block cached by decref(..., keep_cached=True) is counted as cached",
                "allocate": "allocate() takes its block off the free list (or out of `cached`)",
            }.get(last_op, ""),
        )
    if cached != list(m.cached):
        raise t.broken(
            LRU_ORDER,
            f"list(a.cached) == {cached}",
            f"{list(m.cached)}",
            "a block cached by decref(..., keep_cached=True) goes to the most recently "
            "used end: self.cached[block] = None",
        )


def _index(kind: str):
    return {"hash": HashPrefixIndex, "radix": RadixPrefixIndex}[kind]


def check_block_allocator(
    cls: type, verbose: bool = True, raise_on_failure: bool = False
) -> LabResult:
    """Grade a block allocator class (the interface of notebooks/labs/01_block_allocator).

    Checks, each on seeded random operation sequences (a failure is shrunk to the
    smallest sequence that still breaks the same invariant):

    1. allocate and free;  2. shared blocks (reference counts, double frees);
    3. cached blocks (keep_cached, reuse, uncache, LRU eviction, on_evict);
    4. inside kvlab's PagedCache, with hash and radix prefix sharing.
    """

    def ops_check(seed: int, count: int, ops: tuple[str, ...], max_ops: int):
        return lambda: search(_cases(seed, count, ops, max_ops), lambda c: _run(cls, c), _smaller)

    def paged_check(kind: str):
        def check():
            search(
                sharing.random_cases(seed=len(kind), count=30),
                lambda case: sharing.run_sharing_case(
                    case,
                    _index(kind),
                    lambda cache: cls(cache.num_blocks, on_evict=cache._forget),
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
