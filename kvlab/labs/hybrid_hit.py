"""Lab 11 grader: the prefix hit every KV cache group of a hybrid model can serve.

A hybrid model mixes full-attention layers with sliding-window ones, and kvlab's hybrid
cache (kvlab.cache.hybrid, vLLM's hybrid KV cache manager) gives each group of layers of
one kind its own block table and prefix index: a prompt's block may be cached in one
group and gone from another. The learner's

    cross_group_hit(groups, cached, num_blocks, block_size) -> int

returns the longest prefix hit, in blocks, that every group serves: `groups` the model's
KV cache groups (`KVCacheGroup.window`: None for full attention, else W tokens),
`cached(g, i)` whether group g holds block i of the prompt, `num_blocks` the most blocks
the hit may take. A full group serves a hit of h blocks when it holds blocks 0 .. h - 1; a
sliding group when it holds blocks max(0, h - need) .. h - 1, need = ceil((W - 1) /
block_size); the hit shrinks until every group serves it.

The reference is kvlab's own rule, `kvlab.cache.groups.cross_group_hit`, which the hybrid
cache's `prefix_hit` calls at admission. The last check serves the real model in kvlab's
engine (Gemma 3's 5 : 1 pattern), evicts blocks from its groups' prefix indexes, asks the
learner's rule what each next prompt hits in those indexes, and compares it with the
prefix-hit tokens the engine then reports.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from dataclasses import dataclass

from kvlab import texts
from kvlab.build import Engine
from kvlab.cache.groups import KVCacheGroup, cross_group_hit
from kvlab.config import EngineConfig, SamplingParams
from kvlab.labs import kv_cache
from kvlab.labs.grading import SEED_STRIDE, Case, LabResult, Transcript, grade, search
from kvlab.units import ceil_div

HitFn = Callable[[list[KVCacheGroup], Callable[[int, int], bool], int, int], int]

RETURNS = "cross_group_hit returns a whole number of blocks, 0 .. num_blocks"
ASKS = "cached(g, i) is asked only about the groups given and blocks 0 .. num_blocks - 1"
FULL = "a full-attention group serves a hit of h blocks only if it holds blocks 0 .. h - 1"
WINDOW = (
    "a sliding group serves a hit of h blocks only if it holds its last "
    "ceil((W - 1) / block_size) blocks"
)
LONGEST = "the hit is the longest that every group serves"
LIKE_KVLAB = "the same hit as kvlab's cross_group_hit"
ENGINE = "the hit is what kvlab's hybrid cache serves (the engine's prefix-hit tokens)"

kvlab_cross_group_hit = cross_group_hit  # the reference, under the name the lab shows


def groups_of(*windows: int | None) -> list[KVCacheGroup]:
    """KV cache groups with these windows (None: full attention), one layer each: the rule
    reads only the windows."""
    return [KVCacheGroup(window, (g,)) for g, window in enumerate(windows)]


@dataclass(frozen=True)
class HitCase:
    """A question: the groups' windows, the prompt blocks each group holds, the bound."""

    windows: tuple[int | None, ...]
    held: tuple[frozenset[int], ...]
    num_blocks: int
    block_size: int = 16

    def need(self, g: int) -> int | None:
        """Blocks group g needs at the end of a hit (None: every block, full attention)."""
        window = self.windows[g]
        return None if window is None else ceil_div(window - 1, self.block_size)

    def reach(self, g: int, h: int) -> range:
        """The blocks group g needs for a hit of h."""
        need = self.need(g)
        return range(0 if need is None else max(0, h - need), h)

    def lacks(self, g: int, h: int) -> int | None:
        """The first block group g needs for a hit of h and does not hold, or None."""
        return next((i for i in self.reach(g, h) if i not in self.held[g]), None)

    def longest(self) -> int:
        """The longest hit every group serves, by trying every length."""
        groups = range(len(self.windows))
        return max(h for h in range(self.num_blocks + 1)
                   if all(self.lacks(g, h) is None for g in groups))  # fmt: skip

    def code(self, name: str) -> str:
        held = ", ".join(_set(h) for h in self.held)
        return (
            f"groups = groups_of({', '.join(map(repr, self.windows))})\n"
            f"held = [{held}]  # the prompt blocks each group holds\n"
            f"{name}(groups, lambda g, i: i in held[g], {self.num_blocks}, {self.block_size})"
        )


def case(windows: tuple, held: tuple, num_blocks: int, block_size: int = 16) -> HitCase:
    return HitCase(tuple(windows), tuple(frozenset(h) for h in held), num_blocks, block_size)


def _set(blocks) -> str:
    return "{" + ", ".join(map(str, sorted(blocks))) + "}" if blocks else "set()"


def _span(blocks: range) -> str:
    return f"block {blocks[0]}" if len(blocks) == 1 else f"blocks {blocks[0]}..{blocks[-1]}"


def _kind(case: HitCase, g: int) -> str:
    window = case.windows[g]
    return f"group {g} (full attention)" if window is None else f"group {g} (window {window})"


def _ask(fn: HitFn, case: HitCase, log: Transcript) -> int:
    """The learner's hit for `case`; a question out of range breaks ASKS."""

    code = case.code(fn.__name__)

    def cached(g: int, i: int) -> bool:
        if not (0 <= g < len(case.windows) and 0 <= i < case.num_blocks):
            log.add(code, note=f"asked cached({g!r}, {i!r})")
            raise log.broken(
                ASKS,
                f"asked cached({g!r}, {i!r})",
                f"questions cached(g, i) with g < {len(case.windows)} and i < {case.num_blocks}",
                "the hit never takes more than num_blocks blocks (the block of the prompt's "
                "last token always runs): stop before asking past it",
            )
        return i in case.held[g]

    log.pending = code
    got = fn(groups_of(*case.windows), cached, case.num_blocks, case.block_size)
    log.add(code, got)
    if not isinstance(got, int) or isinstance(got, bool) or not 0 <= got <= case.num_blocks:
        raise log.broken(RETURNS, f"returned {got!r}"[:200], f"an int, 0..{case.num_blocks}")
    return got


def _judge(got: int, want: int, case: HitCase) -> tuple[str, str, str, str] | None:
    """(invariant, got, expected, hint) of the first rule `got` breaks, or None."""
    if got == want:
        return None
    groups = range(len(case.windows))
    if got > want:  # some group does not serve it: full groups first
        g = next(g for g in sorted(groups, key=lambda g: case.need(g) is not None)
                 if case.lacks(g, got) is not None)  # fmt: skip
        missing, reach = case.lacks(g, got), case.reach(g, got)
        what = f"returned {got}, but {_kind(case, g)} lacks block {missing}"
        if case.windows[g] is None:
            hint = "a full-attention layer reads every earlier token: the hit ends at its first gap"
            return FULL, what, f"{want}", hint
        longer = [h for h in range(got + 1, case.num_blocks + 1) if case.lacks(g, h) is None]
        if longer:
            hint = (
                f"group {g} serves a hit of {longer[-1]} blocks but not one of {got}: a window's "
                "hits have gaps. Once any group moves the hit left, ask every window again at "
                "the new hit, until none moves it"
            )
        else:
            hint = _need(case, g, got)
        return WINDOW, f"{what} ({_span(reach)} needed)", f"{want}", hint
    reasons = [f"{_kind(case, g)} holds {_span(case.reach(g, want))}" for g in groups if want]
    expected = f"{want}" + (": " + "; ".join(reasons) if reasons else "")
    gap = next((g for g in groups if case.need(g) is not None and
                any(i not in case.held[g] for i in range(want))), None)  # fmt: skip
    if gap is not None:
        hint = _need(case, gap, want) + (
            "; a block missing before them does not stop the hit: scan a window from the "
            "hit's end leftwards, as vLLM's SlidingWindowManager does"
        )
    else:
        hint = "move the hit left only as far as a group needs: to the longest hit it serves"
    return LONGEST, f"returned {got}, but every group serves {want}", expected, hint


def _need(case: HitCase, g: int, h: int) -> str:
    window, bs = case.windows[g], case.block_size
    return (
        f"a hit of {h} needs {_span(case.reach(g, h))} of group {g}: a query reads W - 1 = "
        f"{window - 1} tokens back, ceil({window - 1} / {bs}) = {case.need(g)} block(s)"
    )


def _check(fn: HitFn, case: HitCase, invariant: str | None = None) -> None:
    log = Transcript()
    got, want = _ask(fn, case, log), kvlab_hit(case)
    _raise(_judge(got, want, case), log, invariant)


def _raise(wrong: tuple | None, log: Transcript, invariant: str | None) -> None:
    if wrong is not None:
        broke, what, expected, hint = wrong
        if invariant is not None:
            hint, broke = f"the rule: {broke}; {hint}", invariant
        raise log.broken(broke, what, expected, hint)


def kvlab_hit(case: HitCase) -> int:
    """kvlab's cross_group_hit on a case."""
    groups = groups_of(*case.windows)
    return cross_group_hit(groups, lambda g, i: i in case.held[g], case.num_blocks, case.block_size)


ALL = set(range(8))
NAMED = {
    "full attention only": [
        case([None], [{0, 1, 2, 3}], 6),
        case([None, None], [ALL, {0, 1, 2, 4, 5}], 6),
        case([None], [ALL], 6),  # more held than the hit may take
    ],
    "sliding windows only": [
        case([32], [{0, 1, 2, 3, 4, 5}], 6),
        case([32], [{0, 1, 3, 4, 5}], 6),  # a gap out of the window's reach
        case([32], [{0, 1, 2, 4}], 6),  # the last block missing: the hit moves left
        case([17], [{0, 1, 2, 3, 5}], 6),  # W - 1 = 16 tokens: one block
        case([33], [{0, 1, 2, 4, 5}], 6),
        case([8], [{1, 3, 4, 6}], 7, 4),
        case([32], [{4, 5}], 6),
    ],
    "a window's run forces the hit left": [
        case([None, 32], [ALL, {4, 5}], 6),
        case([None, 32], [ALL, {1, 2, 4}], 6),
        case([None, 32], [{0, 1, 2, 3, 4}, {0, 1, 2, 3, 5}], 6),
        case([None, 32], [{0, 1, 2, 3}, {0, 1, 2, 4, 5}], 6),
        case([None, 32], [ALL, {0}], 6),  # a hit of one block needs block 0 only
    ],
    "two windows move each other": [
        case([32, 48], [{0, 1, 2, 3, 5, 6}, {1, 2, 3, 4, 5, 6}], 7),
        case([32, 48], [{0, 1, 2, 3, 6}, {1, 2, 3, 4, 5, 6}], 7),
        case([32, 48], [{1, 2, 5, 6}, {0, 1, 2, 3}], 7),
        case([None, 32, 32], [ALL, {0, 1, 3, 4, 5}, {0, 1, 2, 4}], 6),
    ],
    "no hit": [
        case([None, 32], [set(), ALL], 6),
        case([None, 32], [ALL, set()], 6),
        case([32], [{1, 3, 5}], 6),
        case([None, 32], [{0, 1, 2, 3}, {4, 5}], 6),
        case([None, 32], [ALL, ALL], 0),
    ],
}


def _named(fn: HitFn, name: str) -> None:
    for c in NAMED[name]:
        _check(fn, c)


def _random_cases(count: int, seed: int) -> list[Case]:
    """Groups full first, then windows ascending (as kvlab.cache.groups makes them)."""
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        bs = rng.choice([1, 2, 4, 16])
        windows = [None if rng.random() < 0.35 else rng.randint(2, 5 * bs + 1)
                   for _ in range(rng.randint(1, 4))]  # fmt: skip
        windows.sort(key=lambda w: (w is not None, w or 0))
        n, p = rng.randint(0, 10), rng.choice([0.5, 0.75, 0.9, 1.0])
        held = tuple((g, i) for g in range(len(windows)) for i in range(n + 2) if rng.random() < p)
        cases.append(Case((tuple(windows), n, bs), held))
    return cases


def random_case(c: Case) -> HitCase:
    """A random case as a question: its ops are the (group, block) pairs held (those of a
    group shrinking took away are left out)."""
    windows, n, bs = c.params
    return case(windows, [{i for g, i in c.ops if g == k} for k in range(len(windows))], n, bs)


def _run_random(fn: HitFn, c: Case) -> None:
    _check(fn, random_case(c), LIKE_KVLAB)


def _smaller(params: tuple) -> list[tuple]:
    windows, n, bs = params
    out = [(windows, n - 1, bs)] if n else []
    if len(windows) > 1:
        out.append((windows[:-1], n, bs))
    return out


# --- the engine --------------------------------------------------------------------------
PATTERN = "window=32*5,full"  # Gemma 3's 5 local : 1 global, over SmolLM2's 30 layers
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Probe:
    """One prompt the engine served: what the groups' indexes held just before, and its hit."""

    story: str  # what happened to the cache before it
    case: HitCase
    hit_tokens: int  # the engine's prefix_hit_tokens


@functools.cache
def engine_probes(seed: int = 0) -> tuple[Probe, ...]:
    """SmolLM2-135M in kvlab's engine (cache="hybrid", PATTERN, hash prefix caching) serves
    a 97-token text, then the text again after each of a few evictions from some groups'
    prefix indexes (the LRU's work, done here as the hybrid cache's `_evict` does it). Per
    prompt: the blocks each group's index held at its admission, and the hit the engine
    served. Cached per seed, so every answer graded is asked about the same states."""
    rng, model = random.Random(seed), kv_cache._model()
    engine = Engine(model, EngineConfig(
        cache="hybrid", block_size=BLOCK_SIZE, prefix_caching="hash", attention_pattern=PATTERN,
        kv_budget_tokens=1024, max_model_len=256,
    ))  # fmt: skip
    cache, params = engine.cache, SamplingParams(max_new_tokens=1, ignore_eos=True)
    ids = model.tokenizer(rng.choice(sorted(texts.documents().values())))["input_ids"]
    start = rng.randrange(len(ids) - 97)
    prompt = ids[start : start + 97]
    engine.generate([prompt], params)  # every group caches the prompt's 6 full blocks
    windows = tuple(group.window for group in cache.groups)
    a, b, c = rng.sample([g for g, w in enumerate(windows) if w is not None], 3)
    k, groups = rng.choice([3, 4, 5]), range(len(windows))
    plan = [  # (what the LRU took before the prompt came, {group: its blocks}, the prompt)
        ("nothing", {}, prompt),
        (f"the last block of group {a}", {a: {5}}, prompt),
        (f"block {k} of group 0, block {k - 1} of group {a}", {0: {k}, a: {k - 1}}, prompt),
        (f"block 2 of group {b}, blocks 3 and 5 of group {c}", {b: {2}, c: {3, 5}}, prompt),
        (f"block {k - 3} of group {c}", {c: {k - 3}}, prompt),
        ("random blocks", {g: {i for i in range(6) if rng.random() < 0.2} for g in groups}, prompt),
        ("nothing; the prompt is its first 96 tokens", {}, prompt[:96]),
    ]  # fmt: skip
    probes = []
    for took, evict, asked in plan:
        keys = cache.index.keys(asked, None)
        for g, blocks in evict.items():
            index = cache.parts[g].index.block_of
            for block in [index[keys[i]] for i in sorted(blocks) if keys[i] in index]:
                cache.parts[g].sharing.forget(block)
                cache.allocator.uncache(block)
        cache.check_integrity()
        held = [
            {i for i, key in enumerate(keys) if key in part.index.block_of} for part in cache.parts
        ]
        bound = min((len(asked) - 1) // BLOCK_SIZE, len(keys))
        served = engine.generate([asked], params)[0].metrics.prefix_hit_tokens
        probes.append(Probe(f"the LRU took {took}", case(windows, held, bound), served))
    return tuple(probes)


def _check_engine(fn: HitFn, seed: int) -> None:
    fn(groups_of(None), lambda g, i: False, 1, BLOCK_SIZE)  # unsolved: say so before serving
    for probe in engine_probes(seed):
        c, served = probe.case, probe.hit_tokens
        log = Transcript()
        log.add(f"# SmolLM2-135M in kvlab's engine: cache='hybrid', attention_pattern={PATTERN!r},")
        log.add(
            f"# block_size={BLOCK_SIZE}, prefix_caching='hash'; a prompt ran, then {probe.story}"
        )
        log.add(
            f"# and the prompt came again: the engine served {served} tokens of it from the cache"
        )
        _raise(_judge(_ask(fn, c, log), served // BLOCK_SIZE, c), log, ENGINE)


def check_cross_group_hit(
    fn: HitFn, verbose: bool = True, raise_on_failure: bool = False, seed: int = 0
) -> LabResult:
    """Grade `cross_group_hit(groups, cached, num_blocks, block_size) -> int` (notebook 11
    of the labs).

    `seed` (default 0, the cases the notebook shows) draws other random cases and another
    engine story for the same checks: the lab sources' hidden tests grade with a seed the
    learner has not seen.
    """
    checks: list[tuple[str, Callable[[], None]]] = [
        (name, functools.partial(_named, fn, name)) for name in NAMED
    ]
    checks += [
        ("random groups vs kvlab's cross_group_hit",
         lambda: search(_random_cases(300, 31 + SEED_STRIDE * seed),
                        lambda c: _run_random(fn, c), _smaller)),
        ("the hit kvlab's engine serves", lambda: _check_engine(fn, seed)),
    ]  # fmt: skip
    return grade("Lab 11 (the cross-group prefix hit)", checks, verbose, raise_on_failure)
