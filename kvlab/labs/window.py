"""Lab 6 grader: which blocks a sliding window (with attention sinks) releases.

After each step, a paged cache with a sliding window of `window` tokens (and, as in
StreamingLLM, the first `sinks` tokens kept for good) gives back every whole block that
lies entirely outside both. The learner's

    release_blocks(table, num_computed, block_size, window, sinks) -> list[int]

returns the logical block indices of `table` to release now. An entry already released
in an earlier step is `DROPPED` (-1) in the table; it must not be released again. Sinks
are kept in whole blocks (the block holding the last sink token stays), the block holding
the newest token always stays, and a block holding any of the last `window` tokens stays.

The reference is kvlab's own rule, `kvlab_release`: the retention policy the paged cache
calls after every step (`RETENTION["window"]`, or `RETENTION["sinks"]` when `sinks` > 0,
kvlab/cache/retention/) and its `drop(table, num_computed)`.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from kvlab.cache.retention import DROPPED, RETENTION
from kvlab.labs.grading import SEED_STRIDE, Case, LabResult, Transcript, grade, search
from kvlab.units import ceil_div

ReleaseFn = Callable[[list[int], int, int, int, int], list[int]]

RETURNS = "release_blocks returns a list of logical block indices of the table, each once"
UNCHANGED = "release_blocks leaves the table as it was (the cache marks released blocks)"
TWICE = "a block already released (DROPPED in the table) is never released again"
NEWEST = "the block holding the newest token is never released"
SINKS = "a block holding one of the first `sinks` tokens is never released"
IN_WINDOW = "a block holding one of the last `window` tokens is never released"
OUTSIDE = "every whole block entirely outside the sinks and the window is released"
LIKE_KVLAB = "the same blocks as kvlab's retention policy (window, or sinks + window)"


def kvlab_release(
    table: list[int], num_computed: int, block_size: int, window: int, sinks: int = 0
) -> list[int]:
    """The logical blocks kvlab's paged cache drops after a step, in order: its "window"
    retention policy, or "sinks" (StreamingLLM) when `sinks` > 0."""
    if sinks:
        policy = RETENTION["sinks"](block_size, len(table), window, sinks)
    else:
        policy = RETENTION["window"](block_size, len(table), window)
    return policy.drop(list(table), num_computed)


def _code(fn: ReleaseFn, table: list[int], nc: int, bs: int, window: int, sinks: int) -> str:
    return f"{fn.__name__}({table}, {nc}, {bs}, window={window}, sinks={sinks})"


def _positions(i: int, bs: int) -> str:
    return f"positions {i * bs}..{(i + 1) * bs - 1}" if bs > 1 else f"position {i}"


def _ask(
    fn: ReleaseFn, table: list[int], nc: int, bs: int, window: int, sinks: int, log: Transcript
) -> list[int]:
    given = list(table)
    code = _code(fn, table, nc, bs, window, sinks)
    log.pending = code
    out = fn(given, nc, bs, window, sinks)
    if given != table:
        log.add(code, note=f"the table became {given}")
        raise log.broken(
            UNCHANGED,
            f"the call changed the table to {given}",
            f"{table}",
            "return the indices; the cache marks them DROPPED and frees the blocks",
        )
    try:
        got = list(out)
    except TypeError:
        log.add(code, out)
        raise log.broken(RETURNS, f"returned {out!r}"[:200], "a list of ints") from None
    log.add(code, got)
    bad = [i for i in got if not isinstance(i, int) or not 0 <= i < len(table)]
    if bad or len(set(got)) != len(got):
        hint = ""
        if bad and all(isinstance(i, int) for i in bad) and set(bad) <= set(table):
            hint = "return logical indices into the table, not the physical block ids"
        elif not bad:
            hint = "each index at most once: the cache would decref its block twice"
        raise log.broken(RETURNS, f"returned {got}", f"distinct indices 0..{len(table) - 1}", hint)
    return got


def _judge(
    got: list[int], want: list[int], table: list[int], nc: int, bs: int, window: int, sinks: int
) -> tuple[str, str, str, str] | None:
    """(invariant, got, expected, hint) of the first rule `got` breaks, or None."""
    expected = f"release {want}" if want else "release nothing"
    newest = (nc - 1) // bs
    first_window = max(nc - window, 0)  # the first of the last `window` tokens
    for i in got:
        if table[i] == DROPPED:
            return (
                TWICE,
                f"released index {i}, but table[{i}] is DROPPED: it went back in an earlier step",
                expected,
                "skip entries equal to DROPPED (-1): that block went back to the free list "
                "in an earlier step and may belong to another sequence now",
            )
    for i in got:
        if i >= newest:
            return (
                NEWEST,
                f"released block {i} ({_positions(i, bs)}); token {nc - 1} is the newest",
                expected,
                "the next token is written into the last block: it is never whole yet",
            )
    for i in got:
        if i * bs < sinks:
            hint = ""
            if i == sinks // bs:
                hint = (
                    "sinks are kept in whole blocks: the block holding the last sink token "
                    "stays (round up: ceil_div(sinks, block_size) blocks)"
                )
            return (
                SINKS,
                f"released block {i} ({_positions(i, bs)}), which holds sink token(s): the "
                f"first {sinks} tokens stay",
                expected,
                hint,
            )
    for i in got:
        if (i + 1) * bs > first_window:
            hint = ""
            if i * bs < first_window:
                hint = (
                    "a block partly inside the window stays: only blocks that end before "
                    f"position {first_window} go"
                )
            return (
                IN_WINDOW,
                f"released block {i} ({_positions(i, bs)}), but the window is the last "
                f"{window} tokens, positions {first_window}..{nc - 1}",
                expected,
                hint,
            )
    missed = [i for i in want if i not in got]
    if missed:
        i = missed[0]
        return (
            OUTSIDE,
            f"released {got}: block {i} ({_positions(i, bs)}) stays, though it lies "
            f"outside the sinks and the window (positions {first_window}..{nc - 1})",
            expected,
            f"between window and window + block_size - 1 tokens stay ({window}..{window + bs - 1}"
            " here); a block is released as soon as its last token leaves the window",
        )
    return None


def _step(
    fn: ReleaseFn,
    table: list[int],
    nc: int,
    bs: int,
    window: int,
    sinks: int,
    log: Transcript,
    invariant: str | None = None,
) -> list[int]:
    got = _ask(fn, table, nc, bs, window, sinks, log)
    want = kvlab_release(table, nc, bs, window, sinks)
    wrong = _judge(got, want, table, nc, bs, window, sinks)
    if wrong is not None:
        broke, what, expected, hint = wrong
        if invariant is not None:
            hint = f"the rule: {broke}" + (f"; {hint}" if hint else "")
            broke = invariant
        raise log.broken(broke, what, expected, hint)
    return want


def _single(fn: ReleaseFn, cases: list[tuple[int, int, int, int]]) -> None:
    """One call each, on a fresh table (a prefill chunk just landed): (nc, bs, window, sinks)."""
    for nc, bs, window, sinks in cases:
        table = [(5 * i + 3) % 97 for i in range(ceil_div(nc, bs))]
        _step(fn, table, nc, bs, window, sinks, Transcript())


def _check_window(fn: ReleaseFn) -> None:
    _single(
        fn,
        [
            (10, 4, 4, 0),
            (12, 4, 4, 0),
            (12, 4, 5, 0),
            (3, 4, 8, 0),
            (5, 1, 1, 0),
            (100, 16, 32, 0),
            (9, 4, 20, 0),
        ],
    )


def _check_sinks(fn: ReleaseFn) -> None:
    _single(
        fn,
        [
            (20, 4, 4, 4),
            (20, 4, 4, 2),
            (20, 4, 4, 5),
            (33, 8, 8, 1),
            (12, 2, 3, 3),
            (10, 4, 8, 4),
            (40, 16, 16, 16),
        ],
    )


def _check_edge(fn: ReleaseFn) -> None:
    # nc - window at, just before and just after a block boundary
    _single(
        fn,
        [
            (16, 4, 8, 0),
            (17, 4, 8, 0),
            (15, 4, 8, 0),
            (13, 4, 9, 0),
            (21, 4, 8, 4),
            (24, 8, 8, 0),
            (25, 8, 8, 0),
        ],
    )


def _run_trace(fn: ReleaseFn, case: Case, invariant: str | None = None) -> None:
    """A sequence grows step by step (chunks, then single tokens); after each step the
    released entries become DROPPED and their blocks return to the free list."""
    bs, window, sinks = case.params
    log = Transcript()
    log.add(f"# block_size={bs}, window={window}, sinks={sinks}; the sequence grows")
    table: list[int] = []
    free = list(range(4, 64))  # released blocks return here and are handed out again
    nc = 0
    for (grow,) in case.ops:
        nc += grow
        while len(table) < ceil_div(nc, bs):
            table.append(free.pop(0))
        for i in _step(fn, list(table), nc, bs, window, sinks, log, invariant):
            free.append(table[i])
            table[i] = DROPPED


def _traces(count: int, seed: int, base: int) -> list[Case]:
    rng = random.Random(base + SEED_STRIDE * seed)
    cases = []
    for _ in range(count):
        bs = rng.choice([1, 2, 4, 4, 8, 16])
        window = rng.randint(1, 3 * bs + 6)
        sinks = rng.choice([0, 0, rng.randint(1, 2 * bs + 2)])
        steps = [rng.randint(1, 3 * bs + 4)] + [rng.choice([1, 1, 1, 2, bs]) for _ in range(30)]
        cases.append(Case((bs, window, sinks), tuple((s,) for s in steps)))
    return cases


def _smaller(params: tuple) -> list[tuple]:
    bs, window, sinks = params
    out = [(bs, w, sinks) for w in (window // 2, window - 1) if w >= 1]
    out += [(bs, window, s) for s in (0, sinks // 2, sinks - 1) if 0 <= s < sinks]
    return out


def _check_growing(fn: ReleaseFn) -> None:
    traces = [
        Case((4, 6, 2), tuple((g,) for g in [5, 1, 1, 1, 1, 1, 1, 1, 1, 4, 1, 1, 1, 1])),
        Case((2, 3, 0), tuple((1,) for _ in range(12))),
    ]
    search(traces, lambda case: _run_trace(fn, case))  # a failure is shrunk to fewer steps


def check_window_release(
    fn: ReleaseFn, verbose: bool = True, raise_on_failure: bool = False, seed: int = 0
) -> LabResult:
    """Grade `release_blocks(table, num_computed, block_size, window, sinks) -> list[int]`
    (notebook 06 of the labs).

    `seed` (default 0, the cases the notebook shows) draws other random cases for the same
    checks: the lab sources' hidden tests grade with a seed the learner has not seen.
    """
    checks = [
        ("whole blocks outside the window", lambda: _check_window(fn)),
        ("sink blocks stay", lambda: _check_sinks(fn)),
        ("the window's edge", lambda: _check_edge(fn)),
        ("a growing sequence, step by step", lambda: _check_growing(fn)),
        (
            "random growth vs kvlab's retention",
            lambda: search(
                _traces(150, seed, 23), lambda case: _run_trace(fn, case, LIKE_KVLAB), _smaller
            ),
        ),
    ]
    return grade("Sliding-window release", checks, verbose, raise_on_failure)
