"""Lab 5 grader: rolling a paged block table back after speculative verification.

A decode step with speculation computes K/V for the pending token and k drafts at once, so
`num_computed` counts the drafts. Verification accepts the first `accepted` of them; the
K/V of the other k - accepted are wrong and are forgotten. The learner's

    rollback(table, block_size, num_computed, num_drafts, accepted, ref_counts)
        -> (num_computed, num_blocks, free_blocks)

returns the rewound `num_computed` (num_computed - (num_drafts - accepted)), how many
blocks of `table` stay (those holding a kept token: ceil(num_computed / block_size)), and
the blocks that go back to the free list: the ones leaving the table that no one else
holds (`ref_counts[block] == 1`). A shared block leaving the table (a fork holds it too)
only loses this table's reference.

The reference is kvlab's own rollback, `kvlab_rollback`: `KVCache.rewind` (the call
`Speculator.rollback` makes) on a real PagedCache laid out like `table`, then kvlab's
`BlockAllocator.decref` of every block leaving the table with the given reference
counts. kvlab's own `_trim` refuses a shared block past the kept tokens (kvlab never forks
a sequence with drafts in flight); the lab's function handles the general case.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import NamedTuple

import torch

from kvlab.cache import BlockAllocator, KVPool, KVSpec, PagedCache
from kvlab.config import SamplingParams
from kvlab.labs.grading import SEED_STRIDE, Broken, Case, LabResult, grade, search
from kvlab.sequence import Sequence
from kvlab.units import ceil_div

RollbackFn = Callable[[list[int], int, int, int, int, dict[int, int]], tuple]

RETURNS = (
    "rollback returns (num_computed, num_blocks, free_blocks): two ints and a list of "
    "blocks of the table, each at most once"
)
UNCHANGED = "rollback leaves its arguments as they were (the cache applies the result)"
KEEPS_KEPT = "a block that still holds a kept token stays in the table and is never freed"
ENDS = "the table ends with the block of the last kept token (later blocks hold only drafts)"
SHARED = "a shared block (ref count > 1) leaving the table is decref'd, not freed"
FREES_OWN = "a block leaving the table that no one else holds returns to the free list"
REWOUND = "num_computed rewinds past the rejected drafts: num_computed - (num_drafts - accepted)"
LIKE_KVLAB = "the same rollback as kvlab's KVCache.rewind and BlockAllocator.decref"


class Rollback(NamedTuple):
    num_computed: int  # tokens whose K/V stay
    num_blocks: int  # blocks left in the table (its first num_blocks)
    free_blocks: list[int]  # blocks back on the free list, in table order


def _kvlab_rewind(
    block_size: int, num_table_blocks: int, num_computed: int, keep: int
) -> tuple[int, int]:
    """(num_computed, table length) after kvlab's KVCache.rewind on a real PagedCache."""
    num_blocks = num_table_blocks + 1
    pool = KVPool(KVSpec(1, 1, 2), num_blocks * block_size, torch.float32, torch.device("cpu"))
    cache = PagedCache(pool, block_size, num_blocks * block_size)
    seq = Sequence(0, [1] * max(num_computed, 1), SamplingParams(max_new_tokens=1))
    cache.allocate_slots(seq)
    cache.ensure_capacity(seq, num_table_blocks * block_size)
    seq.num_computed = num_computed  # the forward computed the pending token and the drafts
    cache.rewind(seq, keep)
    return seq.num_computed, len(cache.block_table(seq))


def kvlab_rollback(
    table: list[int],
    block_size: int,
    num_computed: int,
    num_drafts: int,
    accepted: int,
    ref_counts: dict[int, int] | None = None,
) -> Rollback:
    """What kvlab does with `table` after verifying: which tokens and blocks stay, which
    blocks become free. `ref_counts` maps each block of the table to its reference count
    (default 1: no other table holds it)."""
    if len(set(table)) != len(table):
        raise ValueError(f"a block appears twice in the table {table}")
    if not 0 <= accepted <= num_drafts < num_computed <= len(table) * block_size:
        raise ValueError(
            f"need 0 <= accepted ({accepted}) <= num_drafts ({num_drafts}) < num_computed "
            f"({num_computed}) <= len(table) * block_size ({len(table) * block_size})"
        )
    refs = {b: 1 for b in table} | dict(ref_counts or {})
    kept_tokens, kept_blocks = _kvlab_rewind(
        block_size, len(table), num_computed, num_computed - (num_drafts - accepted)
    )
    allocator = BlockAllocator(len(table))  # logical block i is block i here
    for i, block in enumerate(table):
        if allocator.allocate() != i:
            raise AssertionError("kvlab's allocator hands out blocks in order")
        for _ in range(refs[block] - 1):
            allocator.incref(i)
    free = [table[i] for i in range(kept_blocks, len(table)) if allocator.decref(i)]
    return Rollback(kept_tokens, kept_blocks, free)


# --- asking the learner's function ------------------------------------------------------------
class _Call(NamedTuple):
    table: tuple[int, ...]
    block_size: int
    num_computed: int
    num_drafts: int
    accepted: int
    refs: tuple[tuple[int, int], ...]  # (block, ref count) for every block of the table

    @property
    def ref_counts(self) -> dict[int, int]:
        return dict(self.refs)


def _call(
    table: list[int], bs: int, nc: int, k: int, a: int, shared: dict[int, int] | None = None
) -> _Call:
    refs = {b: 1 for b in table} | dict(shared or {})
    return _Call(tuple(table), bs, nc, k, a, tuple((b, refs[b]) for b in table))


def _code(fn: RollbackFn, c: _Call) -> str:
    return (
        f"{fn.__name__}({list(c.table)}, {c.block_size}, num_computed={c.num_computed}, "
        f"num_drafts={c.num_drafts}, accepted={c.accepted},\n"
        f"    ref_counts={c.ref_counts})"
    )


def _positions(c: _Call, i: int) -> str:
    start, end = i * c.block_size, min((i + 1) * c.block_size, c.num_computed)
    return f"position {start}" if end - start == 1 else f"positions {start}..{end - 1}"


def _ask(fn: RollbackFn, c: _Call) -> Rollback:
    table, refs = list(c.table), c.ref_counts
    out = fn(table, c.block_size, c.num_computed, c.num_drafts, c.accepted, refs)
    example = _code(fn, c)
    if table != list(c.table) or refs != c.ref_counts:
        raise Broken(
            UNCHANGED,
            f"after the call, table == {table} and ref_counts == {refs}",
            f"table == {list(c.table)} and ref_counts == {c.ref_counts}, unchanged",
            "return the answer; the cache trims the table and calls decref itself",
            example,
        )
    try:
        nc, num_blocks, free = out
        free = list(free)
    except (TypeError, ValueError):
        raise Broken(
            RETURNS,
            f"returned {out!r}"[:200],
            "a tuple (num_computed, num_blocks, free_blocks)",
            "",
            example,
        ) from None
    bad = [b for b in free if b not in c.table]
    if not all(isinstance(x, int) for x in (nc, num_blocks)) or bad or len(set(free)) != len(free):
        what = (
            f"free_blocks {free} hold {bad[0]!r}, which is not in the table"
            if bad
            else f"returned ({nc!r}, {num_blocks!r}, {free!r})"
        )
        hint = "return block ids (table entries), not logical indices" if bad else ""
        if len(set(free)) != len(free):
            hint = "a block returned twice would be handed out to two sequences"
        raise Broken(
            RETURNS, what, "two ints and a list of distinct blocks of the table", hint, example
        )
    return Rollback(nc, num_blocks, free)


def _wrong(c: _Call, got: Rollback, want: Rollback) -> tuple[str, str, str, str] | None:
    """(invariant, got, expected, hint) of the first rule `got` breaks, or None."""
    bs, refs = c.block_size, c.ref_counts
    prefix = c.num_computed - c.num_drafts  # tokens before the drafts (the pending one too)
    kept_end = f"the kept tokens are positions 0..{want.num_computed - 1}"
    if got.num_blocks < want.num_blocks:
        i = got.num_blocks
        hint = ""
        if got.num_blocks == want.num_computed // bs:
            hint = "a partly filled last block still holds kept tokens: round up (ceil_div)"
        elif want.num_computed > prefix and got.num_blocks <= ceil_div(prefix, bs):
            hint = "accepted drafts are real tokens now: their K/V stay"
        return (
            KEEPS_KEPT,
            f"kept {got.num_blocks} block(s): block {c.table[i]} (logical block {i}) leaves "
            f"the table, but it holds kept tokens ({_positions(c, i)})",
            f"{want.num_blocks} block(s): {kept_end}",
            hint,
        )
    kept_free = [b for b in got.free_blocks if c.table.index(b) < want.num_blocks]
    if kept_free:
        i = c.table.index(kept_free[0])
        return (
            KEEPS_KEPT,
            f"free_blocks == {got.free_blocks}: block {kept_free[0]} (logical block {i}) "
            f"still holds kept tokens ({_positions(c, i)})",
            f"free_blocks == {want.free_blocks}: {kept_end}",
            "only blocks past the kept tokens can go",
        )
    if got.num_blocks > want.num_blocks:
        i = want.num_blocks
        if got.num_blocks > len(c.table):
            what = f"kept {got.num_blocks} blocks, but the table has only {len(c.table)}"
        else:
            what = (
                f"kept {got.num_blocks} blocks: block {c.table[i]} (logical block {i}, "
                f"{_positions(c, i)}) holds only rejected drafts, yet stays"
            )
        hint = ""
        if want.num_computed % bs == 0:
            hint = (
                "the kept tokens end exactly at a block boundary: the next block holds none "
                "of them (ceil_div(num_computed, block_size), not num_computed // "
                "block_size + 1)"
            )
        return ENDS, what, f"{want.num_blocks} block(s): {kept_end}", hint
    shared = [b for b in got.free_blocks if refs[b] > 1]
    if shared:
        b = shared[0]
        return (
            SHARED,
            f"free_blocks == {got.free_blocks}: block {b} is freed, but its ref count is {refs[b]}",
            f"free_blocks == {want.free_blocks}: block {b} only loses this table's reference "
            f"(its count becomes {refs[b] - 1}); another table still reads it",
            "free a leaving block only when ref_counts[block] == 1",
        )
    lost = [b for b in want.free_blocks if b not in got.free_blocks]
    if lost:
        return (
            FREES_OWN,
            f"free_blocks == {got.free_blocks}: block {lost[0]} leaves the table and no one "
            "else holds it, but it is not freed (it is lost for good)",
            f"free_blocks == {want.free_blocks}",
            "",
        )
    if got.num_computed != want.num_computed:
        hint = ""
        if got.num_computed == c.num_computed:
            hint = "the rejected drafts' K/V stay in the slots, but num_computed must forget them"
        elif got.num_computed == prefix:
            hint = "the accepted drafts stay: subtract only the rejected ones"
        return (
            REWOUND,
            f"num_computed == {got.num_computed}",
            f"{want.num_computed}: {c.num_computed} - ({c.num_drafts} - {c.accepted})",
            hint,
        )
    return None


def _expect(fn: RollbackFn, c: _Call, invariant: str | None = None) -> None:
    got = _ask(fn, c)
    want = kvlab_rollback(
        list(c.table), c.block_size, c.num_computed, c.num_drafts, c.accepted, c.ref_counts
    )
    wrong = _wrong(c, got, want)
    if wrong is None:
        return
    broke, what, expected, hint = wrong
    if invariant is not None:  # the random check names kvlab, and the rule in the hint
        what = f"{tuple(got)}: {what}"
        expected, hint = f"{tuple(want)}", f"the rule: {broke}" + (f"; {hint}" if hint else "")
        broke = invariant
    raise Broken(broke, what, expected, hint, _code(fn, c))


# --- the checks ------------------------------------------------------------------------------
def _check_all_accepted(fn: RollbackFn) -> None:
    for c in (
        _call([7, 3], 4, 8, 3, 3),  # the drafts end exactly at a block boundary
        _call([5, 9, 2], 4, 10, 6, 6),  # six accepted drafts fill blocks 9 and 2
        _call([4, 1, 6, 0, 8], 1, 5, 4, 4),
        _call([11], 16, 9, 0, 0),  # no drafts at all
    ):
        _expect(fn, c)


def _check_last_block(fn: RollbackFn) -> None:
    for c in (
        _call([7, 3], 4, 7, 2, 0),  # positions 5, 6 rejected, inside block 3
        _call([5, 9, 2], 4, 12, 3, 1),
        _call([12, 4], 8, 15, 5, 2),
    ):
        _expect(fn, c)


def _check_boundaries(fn: RollbackFn) -> None:
    for c in (
        _call([7, 3, 12], 4, 9, 4, 0),  # block 12 holds only a rejected draft
        _call([7, 3, 12], 4, 9, 4, 3),  # kept tokens end exactly at the boundary
        _call([2, 8, 6, 1], 4, 13, 8, 2),  # two blocks of rejected drafts
        _call([5, 0, 9, 3], 2, 7, 5, 1),
        _call([1, 4, 0, 7, 2, 9], 1, 6, 4, 2),
        _call([3, 10, 14], 16, 40, 20, 5),
        _call([6, 2], 4, 5, 4, 0),  # everything but the pending token's block goes
    ):
        _expect(fn, c)


def _check_shared(fn: RollbackFn) -> None:
    for c in (
        _call([7, 3, 12], 4, 9, 4, 0, {12: 2}),  # a fork shares the leaving block
        _call([2, 8, 6, 1], 4, 13, 8, 2, {6: 3}),  # one leaving block shared, one not
        _call([2, 8, 6, 1], 4, 13, 8, 2, {2: 2, 8: 2}),  # shared blocks that stay
        _call([5, 0, 9, 3], 2, 7, 5, 0, {0: 2, 9: 2, 3: 2}),
    ):
        _expect(fn, c)


def _cases(count: int, seed: int = 0) -> list[Case]:
    rng = random.Random(17 + SEED_STRIDE * seed)
    cases = []
    for _ in range(count):
        bs = rng.choice([1, 2, 4, 4, 8, 16])
        k = rng.randint(0, 10)
        nc = rng.randint(k + 1, k + 1 + 3 * bs + 4)
        a = rng.randint(0, k)
        table = rng.sample(range(40), ceil_div(nc, bs))
        refs = tuple(rng.choice([1, 1, 1, 2, 3]) for _ in table)
        cases.append(Case((bs, tuple(table), nc, k, a, refs), ()))
    return cases


def _case_call(case: Case) -> _Call:
    bs, table, nc, k, a, refs = case.params
    return _Call(table, bs, nc, k, a, tuple(zip(table, refs)))


def _smaller(params: tuple) -> list[tuple]:
    bs, table, nc, k, a, refs = params
    out = []
    if nc - bs > k and len(table) > 1:  # one block fewer before the drafts
        out.append((bs, table[1:], nc - bs, k, a, refs[1:]))
    if k > 0:  # one draft fewer
        nk, na = k - 1, min(a, k - 1)
        out.append((bs, table[: ceil_div(nc - 1, bs)], nc - 1, nk, na, refs))
    if a > 0:
        out.append((bs, table, nc, k, a - 1, refs))
    if any(r > 1 for r in refs):
        out.append((bs, table, nc, k, a, tuple(1 for _ in refs)))
    if sorted(table) != list(range(len(table))):
        out.append((bs, tuple(range(len(table))), nc, k, a, refs))
    return [(b, t, n, d, x, r[: len(t)]) for b, t, n, d, x, r in out]


def check_spec_rollback(
    fn: RollbackFn, verbose: bool = True, raise_on_failure: bool = False, seed: int = 0
) -> LabResult:
    """Grade `rollback(table, block_size, num_computed, num_drafts, accepted, ref_counts)
    -> (num_computed, num_blocks, free_blocks)` (notebook 05 of the labs).

    `seed` (default 0, the cases the notebook shows) draws other random cases for the same
    checks: the lab sources' hidden tests grade with a seed the learner has not seen.
    """
    checks = [
        ("all drafts accepted", lambda: _check_all_accepted(fn)),
        ("rejected drafts inside the last block", lambda: _check_last_block(fn)),
        ("across block boundaries", lambda: _check_boundaries(fn)),
        ("shared blocks are decref'd, not freed", lambda: _check_shared(fn)),
        (
            "random rollbacks vs kvlab's rewind",
            lambda: search(
                _cases(300, seed), lambda case: _expect(fn, _case_call(case), LIKE_KVLAB), _smaller
            ),
        ),
    ]
    return grade("Speculative rollback", checks, verbose, raise_on_failure)
