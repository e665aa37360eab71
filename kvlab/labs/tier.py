"""Lab 7 grader: a bounded host tier's LRU bookkeeping (eviction, promotion, salts).

Below the device, kvlab keeps evicted cached blocks in a host tier: a bounded table of
block key -> (salt, stored codes), least recently used first (kvlab/cache/tiers/host.py).
The learner's class

    LabHostTier(capacity_blocks)
        .entries                 OrderedDict key -> (salt, value), least recently used first
        .hits, .misses, .refused, .evictions
        .put(key, salt, value)   -> list of (key, salt, value) evicted, for the next tier down
        .get(key, salt)          -> value, or None
        .keys()                  -> the keys held, least recently used first

stores a block (a key already held only becomes most recently used), evicts the least
recently used entries when the tier would hold more than `capacity_blocks`, returns them
so the stack can write them one tier further down, and serves a hit only under the salt
the entry was stored with: another salt's lookup is refused and counted (`refused`), not a
miss, and it does not make the entry recently used.

The reference is kvlab's own `HostTier` (through `TableTier._lookup`), behind the lab's
interface: `KvlabHostTier`.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import torch

from kvlab.cache.codecs import StoredKV
from kvlab.cache.tiers import HostTier
from kvlab.labs.grading import SEED_STRIDE, Broken, Case, LabResult, Transcript, grade, search

COUNTS = ("hits", "misses", "refused", "evictions")
RETURNS = (
    "put returns a list of (key, salt, value) entries; get returns the value or None; "
    "keys() lists the keys held"
)
SERVES = "get returns the value stored under the key (a hit), None for an absent key (a miss)"
SALTED = "get never returns an entry stored under another salt: it refuses, and counts it"
BOUND = (
    "the tier never holds more than capacity_blocks entries, and evicts only when a put "
    "would exceed them"
)
LRU = "a full tier evicts the least recently used entry first"
PROMOTES = "a hit, or a put of a key already held, makes the entry the most recently used"
DEMOTES = "put returns every entry it evicts, with its salt and value, for the next tier down"
COUNTED = "hits, misses, refused and evictions count what happened"
LIKE_KVLAB = "the same contents, order, evictions and counts as kvlab's HostTier"


class KvlabHostTier:
    """kvlab's `HostTier` behind the lab's interface. Values are kept on the side; the tier
    stores a `StoredKV` holding each value's index, as it stores a block's codes."""

    def __init__(self, capacity_blocks: int):
        self.capacity_blocks = capacity_blocks
        self.tier = HostTier(capacity_blocks)
        self._values: list[Any] = []

    def _stored(self, value: Any) -> StoredKV:
        self._values.append(value)
        return StoredKV({"codes": torch.tensor([len(self._values) - 1])})

    def _value(self, stored: StoredKV) -> Any:
        return self._values[int(stored.tensors["codes"][0])]

    def put(self, key, salt, value) -> list[tuple]:
        evicted = self.tier.put(key, salt, self._stored(value))
        self.tier.check_integrity()
        return [(k, s, self._value(stored)) for k, s, stored in evicted]

    def get(self, key, salt):
        stored = self.tier.get(key, salt)
        return None if stored is None else self._value(stored)

    def keys(self) -> list:
        return self.tier.keys()

    @property
    def hits(self) -> int:
        return self.tier.stats.loads

    @property
    def misses(self) -> int:
        return self.tier.stats.misses

    @property
    def refused(self) -> int:
        return self.tier.stats.salt_refusals

    @property
    def evictions(self) -> int:
        return self.tier.stats.evictions


def _counts(tier) -> dict[str, Any]:
    return {name: getattr(tier, name, None) for name in COUNTS}


def _value_of(key: str) -> str:
    return f"kv-{key}"  # a key's stored codes never change


class _Replay:
    """Runs operations on the learner's tier and kvlab's side by side; raises `Broken` at
    the first difference, naming the rule it breaks."""

    def __init__(self, cls: type, capacity: int, invariant: str | None = None):
        self.log = Transcript()
        self.capacity, self.invariant = capacity, invariant
        self.log.add(f"tier = {cls.__name__}({capacity})")
        self.got = cls(capacity)
        self.want = KvlabHostTier(capacity)
        self.salts: dict[str, str | None] = {}  # the salt each held key was stored under

    def broken(self, rule: str, got: str, expected: str, hint: str = "") -> Broken:
        if self.invariant is not None:  # the random check names kvlab, the rule in the hint
            hint = f"the rule: {rule}" + (f"; {hint}" if hint else "")
            rule = self.invariant
        return self.log.broken(rule, got, expected, hint)

    def _keys(self) -> list:
        try:
            return list(self.got.keys())
        except TypeError:
            raise self.broken(RETURNS, "keys() is not a list", "the keys held") from None

    def put(self, key: str, salt: str | None) -> None:
        code = f"tier.put({key!r}, {salt!r}, {_value_of(key)!r})"
        before = self.want.keys()
        lru_first = list(before)
        self.log.pending = code
        out = self.got.put(key, salt, _value_of(key))
        want = self.want.put(key, salt, _value_of(key))
        self.log.add(code, out)
        try:
            got = [tuple(entry) for entry in out]
        except TypeError:
            raise self.broken(RETURNS, f"put returned {out!r}"[:200], f"{want}") from None
        if any(len(entry) != 3 for entry in got):
            raise self.broken(RETURNS, f"put returned {got!r}"[:200], f"{want}")
        keys = self._keys()
        if len(keys) > self.capacity:
            raise self.broken(
                BOUND,
                f"the tier holds {len(keys)} entries {keys}, capacity {self.capacity}",
                f"at most {self.capacity}: {self.want.keys()}",
                "evict while len(self.entries) > capacity_blocks, after storing the new one",
            )
        full = key not in before and len(before) == self.capacity
        if got and not want:
            hint = "" if key in before else "the tier is not full yet: there is room for it"
            if key in before:
                hint = "a key already held takes no more room: it only becomes most recent"
            raise self.broken(
                BOUND,
                f"put evicted {got}, the tier held {len(before)} of {self.capacity}",
                "put evicts nothing here: []",
                hint,
            )
        if want and want[0][0] in keys:
            # kvlab evicted an entry the learner's tier still holds: which did it evict?
            gone = [k for k in lru_first if k not in keys]
            if gone and gone[0] != want[0][0]:
                newest = lru_first[-1] if lru_first else None
                raise self.broken(
                    LRU,
                    f"evicted {gone[0]!r}; least recently used first, the keys were {lru_first}",
                    f"evict {want[0][0]!r}, the least recently used: {want}",
                    "the first key of the OrderedDict is the least recently used: "
                    "popitem(last=False)"
                    if gone[0] == newest or gone[0] == key
                    else "",
                )
            if not gone and not got:
                raise self.broken(
                    BOUND,
                    f"put evicted nothing; the tier holds {keys}",
                    f"evict {want[0][0]!r}: {want}",
                )
        if want and sorted(map(repr, got)) != sorted(map(repr, want)):
            if not got:
                what = (
                    f"put returned [] and {want[0][0]!r} is gone from the tier: lost, not demoted"
                )
            else:
                what = f"put returned {got}"
            raise self.broken(
                DEMOTES,
                what,
                f"{want}",
                "return the (key, salt, value) of each entry popped, so the stack can write "
                "it to the next tier",
            )
        if full and not got:
            raise self.broken(BOUND, f"put evicted nothing, the tier holds {keys}", f"{want}")
        self.salts.setdefault(key, salt)
        for k, *_ in want:
            self.salts.pop(k, None)
        self._compare_keys(key)
        self._compare_counts()

    def get(self, key: str, salt: str | None) -> None:
        code = f"tier.get({key!r}, {salt!r})"
        held = key in self.want.keys()
        self.log.pending = code
        got = self.got.get(key, salt)
        want = self.want.get(key, salt)
        self.log.add(code, got, "" if got is not None else "-> None")
        if held and self.salts.get(key) != salt and got is not None:
            raise self.broken(
                SALTED,
                f"get returned {got!r}, stored under salt {self.salts[key]!r}",
                "None: another tenant's block is never served",
                "compare the salt stored with the entry to the salt asked for",
            )
        if got != want:
            raise self.broken(
                SERVES,
                f"get returned {got!r}",
                f"{want!r}" + ("" if held else f": {key!r} is not in the tier"),
            )
        self._compare_keys(key if want is not None else None)
        self._compare_counts()

    def _compare_keys(self, touched: str | None) -> None:
        keys, want = self._keys(), self.want.keys()
        if keys == want:
            return
        if sorted(map(repr, keys)) == sorted(map(repr, want)) and touched is not None:
            if keys[-1] != touched:
                raise self.broken(
                    PROMOTES,
                    f"keys() == {keys}, least recently used first: {touched!r} is not the most "
                    "recent",
                    f"{want}",
                    "self.entries.move_to_end(key) (assigning to a key already in an "
                    "OrderedDict keeps its place)",
                )
        if sorted(map(repr, keys)) == sorted(map(repr, want)):
            raise self.broken(
                PROMOTES,
                f"keys() == {keys}, least recently used first",
                f"{want}",
                "only a hit or a put makes an entry recent (a refused get does not)",
            )
        raise self.broken(LIKE_KVLAB, f"keys() == {keys}", f"{want}")

    def _compare_counts(self) -> None:
        got, want = _counts(self.got), _counts(self.want)
        if got != want:
            wrong = [f"{k}={got[k]!r}" for k in COUNTS if got[k] != want[k]]
            right = [f"{k}={want[k]!r}" for k in COUNTS if got[k] != want[k]]
            hint = ""
            if got["misses"] != want["misses"] and got["refused"] != want["refused"]:
                hint = "a lookup under another salt is refused, not missed: count it in refused"
            raise self.broken(COUNTED, ", ".join(wrong), ", ".join(right), hint)


def _run(cls: type, case: Case, invariant: str | None = None) -> None:
    (capacity,) = case.params
    replay = _Replay(cls, capacity, invariant)
    for op, key, salt in case.ops:
        if op == "put":
            replay.put(key, salt)
        else:
            replay.get(key, salt)


def _case(capacity: int, *ops: tuple) -> Case:
    return Case((capacity,), ops)


A, B = "tenant-a", "tenant-b"


def _check_hits(cls: type) -> None:
    for case in (
        _case(4, ("put", "a", A), ("get", "a", A), ("get", "b", A), ("put", "b", A)),
        _case(2, ("get", "a", None), ("put", "a", None), ("get", "a", None), ("get", "a", None)),
    ):
        _run(cls, case)


def _check_lru(cls: type) -> None:
    for case in (
        _case(3, *[("put", k, A) for k in "abcde"]),
        _case(1, ("put", "a", A), ("put", "b", A), ("get", "a", A), ("get", "b", A)),
        _case(2, ("put", "a", A), ("put", "b", B), ("put", "c", A), ("put", "d", A)),
    ):
        _run(cls, case)


def _check_promotes(cls: type) -> None:
    for case in (
        _case(3, *[("put", k, A) for k in "abc"], ("get", "a", A), ("put", "d", A)),
        _case(3, *[("put", k, A) for k in "abc"], ("put", "a", A), ("put", "d", A)),
        _case(2, ("put", "a", A), ("put", "b", A), ("get", "a", A), ("get", "b", A)),
    ):
        _run(cls, case)


def _check_salts(cls: type) -> None:
    for case in (
        _case(3, ("put", "a", A), ("get", "a", B), ("get", "a", None), ("get", "a", A)),
        _case(2, ("put", "a", A), ("put", "b", A), ("get", "a", B), ("put", "c", A)),
        _case(2, ("put", "a", None), ("get", "a", A), ("get", "b", A)),
    ):
        _run(cls, case)


def _cases(count: int, seed: int) -> list[Case]:
    rng = random.Random(29 + SEED_STRIDE * seed)
    cases = []
    for _ in range(count):
        capacity = rng.randint(1, 5)
        keys = "abcdefgh"[: rng.randint(2, 8)]
        salt_of = {k: rng.choice([A, A, B, None]) for k in keys}  # a key implies its salt
        ops = []
        for _ in range(rng.randint(5, 40)):
            key = rng.choice(keys)
            if rng.random() < 0.5:
                ops.append(("put", key, salt_of[key]))
            else:
                salt = salt_of[key] if rng.random() < 0.8 else rng.choice([A, B, None])
                ops.append(("get", key, salt))
        cases.append(Case((capacity,), tuple(ops)))
    return cases


def _smaller(params: tuple) -> list[tuple]:
    (capacity,) = params
    return [(c,) for c in (capacity // 2, capacity - 1) if c >= 1]


def check_tier_lru(
    cls: Callable[[int], Any], verbose: bool = True, raise_on_failure: bool = False, seed: int = 0
) -> LabResult:
    """Grade `cls(capacity_blocks)`, a bounded LRU tier (notebook 07 of the labs).

    `seed` (default 0, the cases the notebook shows) draws other random cases for the same
    checks: the lab sources' hidden tests grade with a seed the learner has not seen.
    """
    checks = [
        ("hits and misses", lambda: _check_hits(cls)),
        ("full: the least recently used goes down", lambda: _check_lru(cls)),
        ("a hit is promoted", lambda: _check_promotes(cls)),
        ("another salt is refused", lambda: _check_salts(cls)),
        (
            "random operations vs kvlab's host tier",
            lambda: search(_cases(200, seed), lambda case: _run(cls, case, LIKE_KVLAB), _smaller),
        ),
    ]
    return grade("Tier LRU", checks, verbose, raise_on_failure)
