"""Lab 2 grader: the chained block hash behind vLLM-style prefix caching.

`block_keys(tokens, block_size, salt)` must give one key per full block, and two keys
must be equal exactly when the token prefixes up to the end of their blocks are equal
and the salts are equal. The grader probes that with crafted pairs (reordered tokens,
digits that run together, ids past 2**8 and 2**16, equal sums), compares the equality
pattern on random prompts with kvlab's HashPrefixIndex, and finally serves random
traffic through kvlab's PagedCache with the learner's keys in its index.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable

from kvlab.cache import HashPrefixIndex
from kvlab.labs import sharing
from kvlab.labs.grading import SEED_STRIDE, Broken, LabResult, grade, search

KeysFn = Callable[[list[int], int, "str | None"], list[Hashable]]

FULL_BLOCKS = "one key per full block (a partly filled last block gets none)"
HASHABLE = "keys are hashable values (they index a dict)"
STABLE = "the same prefix always gives the same keys"
CHAINED = "a block's key depends on every earlier block (the chain)"
DISTINCT = "different blocks get different keys (no collisions)"
SALTED = "requests with different salts never share a key"
LIKE_KVLAB = "keys are equal exactly where kvlab's HashPrefixIndex keys are equal"


def _call(fn: KeysFn, tokens: list[int], block_size: int, salt: str | None) -> list:
    given = list(tokens)
    keys = fn(given, block_size, salt)
    code = f"block_keys({tokens}, {block_size}, {salt!r})"
    if given != tokens:
        raise Broken(STABLE, f"{code} changed its tokens argument to {given}", "tokens unchanged")
    try:
        keys = list(keys)
    except TypeError:
        raise Broken(FULL_BLOCKS, f"{code} returned {keys!r}", "a list of keys") from None
    for key in keys:
        try:
            hash(key)
        except TypeError:
            raise Broken(
                HASHABLE,
                f"{code} returned a key of type {type(key).__name__}",
                "bytes, str, int or a tuple: something a dict can use as a key",
                "return digest.digest() (bytes) or a tuple, not a list or a hash object",
            ) from None
    return keys


def _check_lengths(fn: KeysFn) -> None:
    for block_size in (1, 2, 3, 4, 16):
        for length in range(0, 3 * block_size + 2):
            tokens = [(7 * i + 1) % 100 for i in range(length)]
            keys = _call(fn, tokens, block_size, None)
            if len(keys) != length // block_size:
                raise Broken(
                    FULL_BLOCKS,
                    f"len(block_keys({tokens}, {block_size}, None)) == {len(keys)}",
                    f"{length // block_size}: {length} token(s) fill {length // block_size} "
                    f"full block(s) of {block_size}",
                    "a partly filled last block gets no key yet: its contents will still "
                    "change as the sequence grows, so no other request can share it",
                )


def _check_stable(fn: KeysFn) -> None:
    rng = random.Random(5)
    for block_size in (1, 2, 4):
        for _ in range(20):
            tokens = [rng.randrange(50_000) for _ in range(rng.randint(1, 5) * block_size)]
            salt = rng.choice([None, "tenant-a"])
            keys = _call(fn, tokens, block_size, salt)
            again = _call(fn, list(tokens), block_size, salt)
            if keys != again:
                raise Broken(
                    STABLE,
                    f"two calls of block_keys({tokens}, {block_size}, {salt!r}) gave "
                    f"{keys} and then {again}",
                    "equal keys: the same prefix must find the same cached blocks",
                    "don't hash object identities (id()) or random values",
                )
            for n in range(len(keys)):
                head = tokens[: n * block_size + rng.randrange(block_size)]
                first = _call(fn, head, block_size, salt)
                if first != keys[:n]:
                    raise Broken(
                        STABLE,
                        f"block_keys({head}, {block_size}, {salt!r}) == {first}, but the "
                        f"first {n} keys of block_keys({tokens}, {block_size}, {salt!r}) are "
                        f"{keys[:n]}",
                        "equal keys: a block's key depends only on the tokens up to the end "
                        "of that block, so later tokens (and a partial block) change nothing",
                    )


def _must_differ(
    fn: KeysFn, a: tuple[list[int], str | None], b: tuple[list[int], str | None], bs: int
) -> tuple[int, str] | None:
    """The first block index where a and b's keys are equal, with the code that shows it."""
    ka, kb = _call(fn, a[0], bs, a[1]), _call(fn, b[0], bs, b[1])
    for i, (x, y) in enumerate(zip(ka, kb)):
        if x == y:
            left = f"block_keys({a[0]}, {bs}, {a[1]!r})[{i}]"
            return i, f"{left} == block_keys({b[0]}, {bs}, {b[1]!r})[{i}]"
    return None


CHAIN_PAIRS = [  # same block content after a different parent: keys must differ
    (([1, 2, 5, 6], None), ([3, 4, 5, 6], None), 2),
    (([9, 5], None), ([8, 5], None), 1),
    (([1, 2, 3, 4, 7, 7, 7, 7], "t"), ([4, 3, 2, 1, 7, 7, 7, 7], "t"), 4),
    (([5, 6, 1, 2, 5, 6], None), ([1, 2, 1, 2, 5, 6], None), 2),
]
COLLISION_PAIRS = [  # different blocks that naive hashing maps to one key
    (([1, 2], None), ([2, 1], None), 2, "token order inside a block matters"),
    (([1, 4], None), ([2, 3], None), 2, "equal sums: hash the tokens, not their sum"),
    (([1, 2], None), ([3, 0], None), 2, "equal XOR: hash the tokens, not their XOR"),
    (([1, 23], None), ([12, 3], None), 2, 'joined digits: "1"+"23" == "12"+"3"'),
    (([1, 12, 5], None), ([11, 2, 5], None), 3, "joined digits need a separator"),
    (([256], None), ([0], None), 1, "ids above 255 do not fit in one byte"),
    (([70_000], None), ([4_464], None), 1, "ids above 65535 do not fit in 16 bits"),
    (([49_151, 7], None), ([7, 49_151], None), 2, "order matters for large ids too"),
    (([0, 0, 0, 0], None), ([0, 0, 0, 1], None), 4, "the last token of a block counts"),
]
SALT_PAIRS = [
    (([1, 2, 3, 4], None), ([1, 2, 3, 4], "tenant-a"), 2),
    (([1, 2, 3, 4], "tenant-a"), ([1, 2, 3, 4], "tenant-b"), 2),
    (([5], "a"), ([5], "b"), 1),
    (([23], "1"), ([3], "12"), 1),  # salt and tokens must not run together either
]


def _check_chained(fn: KeysFn) -> None:
    for (ta, sa), (tb, sb), bs in CHAIN_PAIRS:
        ka, kb = _call(fn, ta, bs, sa), _call(fn, tb, bs, sb)
        for i, (x, y) in enumerate(zip(ka, kb)):
            if ta[i * bs : (i + 1) * bs] != tb[i * bs : (i + 1) * bs]:
                if x == y:
                    break  # different blocks, one key: the collision check's business
                continue
            if x == y:  # the same block after different parents
                raise Broken(
                    CHAINED,
                    f"block_keys({ta}, {bs}, {sa!r})[{i}] == block_keys({tb}, {bs}, {sb!r})[{i}]",
                    f"different keys: the prompts differ before block {i}, so block {i}'s "
                    "K/V differ too (attention mixes in every earlier token)",
                    "feed the previous block's key into each block's hash: "
                    "key_i = H(key_{i-1}, tokens of block i, salt)",
                )


def _check_distinct(fn: KeysFn) -> None:
    for a, b, bs, why in COLLISION_PAIRS:
        hit = _must_differ(fn, a, b, bs)
        if hit:
            raise Broken(
                DISTINCT,
                hit[1],
                "different keys: the blocks hold different tokens",
                f"{why}. Hash each token as a fixed-width integer, e.g. "
                "token.to_bytes(8, 'little', signed=True), into hashlib.blake2b or sha256",
            )


def _check_salted(fn: KeysFn) -> None:
    for a, b, bs in SALT_PAIRS:
        hit = _must_differ(fn, a, b, bs)
        if hit:
            raise Broken(
                SALTED,
                hit[1],
                f"different keys: salts {a[1]!r} and {b[1]!r} are different tenants (or "
                "cache versions), and one must never read the other's K/V",
                "hash the salt into every block's key, kept apart from the tokens "
                "(e.g. a b'salt:' prefix), or at least into the first block's key",
            )


def kvlab_block_keys(tokens: list[int], block_size: int, salt: str | None) -> list[bytes]:
    """kvlab's own keys, `HashPrefixIndex(block_size).keys(tokens, salt)`: the reference."""
    return HashPrefixIndex(block_size).keys(tokens, salt)


def _corpus(seed: int) -> list[tuple[list[int], str | None]]:
    """Prompts over a tiny vocabulary, so equal blocks and shared prefixes are common."""
    rng = random.Random(seed)
    corpus = []
    for _ in range(60):
        tokens = [rng.randrange(3) for _ in range(rng.randint(1, 9))]
        salt = rng.choice([None, "a", "b"])
        corpus.append((tokens, salt))
        corpus.append((tokens[: rng.randint(0, len(tokens))] + [rng.randrange(3)], salt))
        corpus.append((list(tokens), rng.choice([None, "a", "b"])))
    return corpus


def _check_like_kvlab(fn: KeysFn, seed: int = 0) -> None:
    for bs in (1, 2, 3):
        ours: dict[Hashable, tuple] = {}  # reference key -> (learner key, prefix, salt)
        theirs: dict[Hashable, tuple] = {}  # learner key -> (reference key, prefix, salt)
        for tokens, salt in _corpus(bs + SEED_STRIDE * seed):
            keys = _call(fn, tokens, bs, salt)
            for i, (want, got) in enumerate(zip(kvlab_block_keys(tokens, bs, salt), keys)):
                prefix = tokens[: (i + 1) * bs]
                seen = ours.setdefault(want, (got, prefix, salt))
                if seen[0] != got:
                    raise Broken(
                        LIKE_KVLAB,
                        f"block_keys({seen[1]}, {bs}, {seen[2]!r})[-1] != "
                        f"block_keys({prefix}, {bs}, {salt!r})[-1]",
                        "equal keys: same tokens up to the end of the block, same salt",
                    )
                other = theirs.setdefault(got, (want, prefix, salt))
                if other[0] != want:
                    raise Broken(
                        LIKE_KVLAB,
                        f"block_keys({other[1]}, {bs}, {other[2]!r})[-1] == "
                        f"block_keys({prefix}, {bs}, {salt!r})[-1]",
                        "different keys: the prefixes or the salts differ",
                    )


class _LearnerIndex(HashPrefixIndex):
    """kvlab's hash prefix index, with the learner's keys."""

    def __init__(self, block_size: int, fn: KeysFn):
        super().__init__(block_size)
        self.fn = fn

    def keys(self, tokens: list[int], salt: str | None) -> list:
        return list(self.fn(list(tokens), self.block_size, salt))


def check_block_hash(
    fn: KeysFn, verbose: bool = True, raise_on_failure: bool = False, seed: int = 0
) -> LabResult:
    """Grade `block_keys(tokens, block_size, salt) -> list of keys` (notebook 02_block_hash).

    `seed` (default 0, the cases the notebook shows) draws other random cases for the same
    checks: the lab sources' hidden tests grade with a seed the learner has not seen.
    """

    def in_cache() -> None:
        search(
            sharing.random_cases(seed=7 + SEED_STRIDE * seed, count=40),
            lambda case: sharing.run_sharing_case(case, lambda bs: _LearnerIndex(bs, fn)),
            sharing.smaller_params,
        )

    checks = [
        ("one key per full block", lambda: _check_lengths(fn)),
        ("same prefix, same keys", lambda: _check_stable(fn)),
        ("chained: earlier blocks change the key", lambda: _check_chained(fn)),
        ("no collisions between different blocks", lambda: _check_distinct(fn)),
        ("salts keep tenants apart", lambda: _check_salted(fn)),
        (
            "random prompts: equal keys exactly where kvlab's are",
            lambda: _check_like_kvlab(fn, seed),
        ),
        ("inside PagedCache: prompts and tenants stay separate", in_cache),
    ]
    return grade("Chained block hash", checks, verbose, raise_on_failure)
