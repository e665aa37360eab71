"""Lab 9 grader: the precise scorer of a cache-aware router (longest cached prefix per
replica, from the replicas' KV events).

A router in front of several engine replicas reads their KV events (vLLM's wire format,
as kvlab serve publishes them: kvlab/serve/kv_events.py) and keeps, per replica, which
block hashes it holds. The learner's class

    LabScorer()
        .apply(replica, event)        one event map: {"type": "BlockStored",
                                      "block_hashes": [...], "parent_block_hash": ...,
                                      "token_ids": [...], "block_size": 16, ...},
                                      {"type": "BlockRemoved", "block_hashes": [...]} or
                                      {"type": "AllBlocksCleared"}
        .score(hashes, replicas)      -> {replica: how many of `hashes` (a request's chain
                                      of block hashes, first block first) it holds in a
                                      row from the first}

must follow what every replica stores and removes, keep replicas apart (a hash stored on
two replicas is removed from one only; a reset clears one replica), and stop a replica's
count at its first missing block: an engine's own lookup walks the chain from the first
block and stops at the first miss, so a block held after a gap cannot be used.

The reference is kvlab's router index (`kvlab.route.index.BlockIndex`) behind the lab's
interface: `KvlabScorer`. The last check drives three real `PagedCache`s with vLLM's
sha256_cbor block hashes, feeds the learner their real events, and asks for each request
what each replica's own cache would hit.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from kvlab.cache import KVPool, KVSpec, PagedCache
from kvlab.cache.events import EventLog
from kvlab.cache.prefix.hash import HashPrefixIndex
from kvlab.config import SamplingParams
from kvlab.labs.grading import SEED_STRIDE, Case, LabResult, Transcript, grade, search
from kvlab.route.hashing import token_block_hashes
from kvlab.route.index import BlockIndex
from kvlab.sequence import Sequence
from kvlab.serve.kv_events import wire_event

FOUND = "a replica that stored a request's blocks scores all of them"
GAP = "a replica's score stops at its first missing block (the engine's lookup does)"
EVERY = "every replica asked about is scored, on its own blocks only (0 if it holds none)"
REMOVED = "BlockRemoved forgets the block on that replica, and on that replica only"
CLEARED = "AllBlocksCleared empties that replica, and that replica only"
RETURNS = "score returns a dict {replica: int} with every replica asked about"
LIKE_KVLAB = "the same scores as kvlab's router index, event after event"
REAL = "the score is what each replica's own cache would hit for the request"


class KvlabScorer:
    """kvlab's router index (kvlab.route.index.BlockIndex) behind the lab's interface."""

    def __init__(self):
        self.index = BlockIndex()

    def apply(self, replica: str, event: dict) -> None:
        self.index.apply(replica, event)

    def score(self, hashes: list[int], replicas: list[str]) -> dict[str, int]:
        return self.index.longest_prefix(list(hashes), list(replicas))


def stored(hashes: list[int], block_size: int = 4, parent: int | None = None) -> dict:
    """A BlockStored event for `hashes` (token ids made up: one run of 100s per block)."""
    tokens = [100 * h + i for h in hashes for i in range(block_size)]
    return {"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": parent,
            "token_ids": tokens, "block_size": block_size, "lora_id": None, "medium": "GPU",
            "lora_name": None}  # fmt: skip


def removed(hashes: list[int]) -> dict:
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": "GPU"}


CLEAR = {"type": "AllBlocksCleared"}


def _short(event: dict) -> str:
    """An event as code to paste: stored([...]), removed([...]) or CLEAR."""
    if event["type"] == "BlockStored":
        parent = event.get("parent_block_hash")
        tail = f", parent={parent}" if parent is not None else ""
        return f"stored({event['block_hashes']}{tail})"
    if event["type"] == "BlockRemoved":
        return f"removed({event['block_hashes']})"
    return "CLEAR"


class _Replay:
    """Events and queries on the learner's scorer and kvlab's side by side."""

    def __init__(self, cls: type, invariant: str | None = None):
        self.log = Transcript()
        self.log.add(f"s = {cls.__name__}()")
        self.got, self.want, self.invariant = cls(), KvlabScorer(), invariant

    def apply(self, replica: str, event: dict) -> None:
        code = f"s.apply({replica!r}, {_short(event)})"
        self.log.pending = code
        self.got.apply(replica, event)
        self.want.apply(replica, event)
        self.log.add(code)

    def score(self, hashes: list[int], replicas: list[str], rule: str, hint: str = "") -> None:
        code = f"s.score({hashes}, {replicas})"
        self.log.pending = code
        got = self.got.score(list(hashes), list(replicas))
        want = self.want.score(hashes, replicas)
        self.log.add(code, got)
        if not isinstance(got, dict) or set(got) != set(replicas):
            raise self.log.broken(RETURNS, f"{got!r}"[:200], f"{want}")
        if any(not isinstance(v, int) or isinstance(v, bool) for v in got.values()):
            raise self.log.broken(RETURNS, f"{got!r}"[:200], f"{want}: whole numbers of blocks")
        if got != want:
            if self.invariant is not None:
                hint, rule = f"the rule: {rule}" + (f"; {hint}" if hint else ""), self.invariant
            raise self.log.broken(rule, f"{got}", f"{want}", hint)


def _check_found(cls) -> None:
    r = _Replay(cls)
    r.apply("r0", stored([1, 2, 3]))
    r.score([1, 2, 3], ["r0"], FOUND, "count the request's hashes the replica holds")
    r.score([1, 2, 3, 4, 5], ["r0"], FOUND, "blocks the replica never stored do not count")
    r.apply("r0", stored([4], parent=3))
    r.score([1, 2, 3, 4, 5], ["r0"], FOUND, "a later BlockStored extends the chain")


def _check_gap(cls) -> None:
    r = _Replay(cls)
    r.apply("r0", stored([1, 2, 3, 4]))
    r.score([1, 9, 3, 4], ["r0"], GAP, "stop counting at the first hash the replica lacks")
    r.apply("r0", removed([2]))
    r.score([1, 2, 3, 4], ["r0"], GAP, "block 2 is gone: blocks 3 and 4 cannot be reached")
    r.score([7, 1, 2], ["r0"], GAP, "a chain that starts with a missing block scores 0")


def _check_every(cls) -> None:
    r = _Replay(cls)
    r.apply("r0", stored([1, 2]))
    r.apply("r1", stored([1, 2, 3]))
    r.score([1, 2, 3], ["r0", "r1", "r2"], EVERY, "r2 sent no event: it holds nothing")
    r.apply("r2", stored([5, 6]))
    r.score([5, 6], ["r0", "r1", "r2"], EVERY, "blocks stored on r2 count for r2 only")
    r.score([1, 2, 3], ["r1"], EVERY, "score only the replicas asked about")


def _check_removed(cls) -> None:
    r = _Replay(cls)
    r.apply("r0", stored([1, 2, 3]))
    r.apply("r1", stored([1, 2, 3]))
    r.apply("r0", removed([3]))
    r.score([1, 2, 3], ["r0", "r1"], REMOVED, "r1 still holds block 3")
    r.apply("r1", removed([1]))
    r.score([1, 2, 3], ["r0", "r1"], REMOVED, "r0 still holds block 1")
    r.apply("r0", removed([8]))  # never stored there: nothing to forget
    r.score(
        [1, 2], ["r0", "r1"], REMOVED, "removing a block a replica never stored changes nothing"
    )
    r.apply("r0", stored([3], parent=2))
    r.score([1, 2, 3], ["r0", "r1"], REMOVED, "a block stored again counts again")


def _check_cleared(cls) -> None:
    r = _Replay(cls)
    r.apply("r0", stored([1, 2]))
    r.apply("r1", stored([1, 2]))
    r.apply("r0", CLEAR)
    r.score([1, 2], ["r0", "r1"], CLEARED, "r1 did not reset: it keeps its blocks")
    r.apply("r0", stored([1]))
    r.score([1, 2], ["r0", "r1"], CLEARED, "after a reset the replica fills up again")


def _random_cases(seed: int) -> list[Case]:
    rng = random.Random(seed)
    cases = []
    for _ in range(30):
        ops = []
        for _ in range(rng.randint(1, 30)):
            replica = f"r{rng.randrange(3)}"
            kind = rng.choices(["stored", "removed", "clear", "score"], [5, 3, 1, 3])[0]
            start = rng.randrange(6)
            if kind == "stored":
                ops.append((replica, stored(list(range(start, start + rng.randint(1, 4))),
                                            parent=start - 1 if start else None)))  # fmt: skip
            elif kind == "removed":
                ops.append((replica, removed([rng.randrange(9)])))
            elif kind == "clear":
                ops.append((replica, CLEAR))
            else:
                ops.append(("?", list(range(rng.choice([0, 0, 1]), rng.randint(2, 9)))))
        cases.append(Case((), tuple(ops)))
    return cases


def _run_random(cls, case: Case) -> None:
    r = _Replay(cls, invariant=LIKE_KVLAB)
    for replica, what in case.ops:
        if replica == "?":
            r.score(what, ["r0", "r1", "r2"], "the longest run of held blocks from the first")
        else:
            r.apply(replica, what)
    r.score(list(range(9)), ["r0", "r1", "r2"], "the longest run of held blocks from the first")


def _real_replicas(cls, seed: int) -> None:
    """Three PagedCaches with vLLM's block hashes; requests from a few families go to a
    random replica, finish at random, and evict under pressure. After every operation the
    learner's scorer has read that operation's events; its score for a few prompts must be
    each cache's own prefix hit."""
    rng = random.Random(seed)
    bs, names, logs, caches = 4, ["r0", "r1", "r2"], [], []
    for _ in names:
        log = EventLog()
        pool = KVPool(KVSpec(1, 1, 2), 14 * bs, torch.float32, torch.device("cpu"))
        index = HashPrefixIndex(bs, "sha256_cbor", events=log)
        caches.append(PagedCache(pool, bs, 64, prefix_index=index))
        logs.append(log)
    families = [[50 * f + i for i in range(12)] for f in range(4)]
    scorer, transcript, running = cls(), Transcript(), []
    transcript.add("# three PagedCaches (14 blocks of 4), vLLM's block hashes, random traffic")

    def prompt() -> tuple[list[int], str | None]:
        head = rng.choice(families)[: rng.randint(2, 12)]
        return head + [rng.randrange(900, 999) for _ in range(rng.randint(0, 6))], rng.choice(
            [None, None, "t1"]
        )

    for step in range(40):
        i = rng.randrange(3)
        cache = caches[i]
        if running and rng.random() < 0.4:
            j, seq = running.pop(rng.randrange(len(running)))
            caches[j].free(seq)
            transcript.add(f"# replica r{j} finishes request {seq.request_id}")
        else:
            tokens, salt = prompt()
            seq = Sequence(step, tokens, SamplingParams(max_new_tokens=1))
            seq.salt = salt
            if cache.allocate_slots(seq) is not None:
                seq.num_computed = len(tokens)
                cache.publish(seq)
                running.append((i, seq))
                transcript.add(f"# replica r{i} computes {len(tokens)} tokens (salt {salt!r})")
        for name, log in zip(names, logs):
            for event in log.take():
                wire = wire_event(event)
                transcript.pending = f"s.apply({name!r}, {_short(wire)})"
                scorer.apply(name, wire)
        for _ in range(3):
            tokens, salt = prompt()
            hashes = token_block_hashes(tokens, bs, salt)
            got = scorer.score(list(hashes), list(names))
            want = {n: len(c.index.match(tokens[: len(tokens) - 1], salt).blocks)
                    for n, c in zip(names, caches)}  # fmt: skip
            if got != want:
                transcript.add(f"s.score(<{len(hashes)} hashes of a {len(tokens)}-token prompt,"
                               f" salt {salt!r}>, {names})", got)  # fmt: skip
                raise transcript.broken(
                    REAL, f"{got}", f"{want}: each replica's cache.index.match(prompt)",
                    "the events are each replica's whole story: apply every one, per replica",
                )  # fmt: skip


def check_precise_scorer(
    cls: type, verbose: bool = True, raise_on_failure: bool = False, seed: int = 0
) -> LabResult:
    """Grade a precise scorer class (see the module docstring)."""
    shift = seed * SEED_STRIDE
    checks: list[tuple[str, Callable[[], None]]] = [
        ("a stored chain is found", lambda: _check_found(cls)),
        ("the prefix stops at the first missing block", lambda: _check_gap(cls)),
        ("every replica scored on its own blocks", lambda: _check_every(cls)),
        ("BlockRemoved forgets one replica's block", lambda: _check_removed(cls)),
        ("AllBlocksCleared resets one replica", lambda: _check_cleared(cls)),
        ("random event streams: the same scores as kvlab's index",
         lambda: search(_random_cases(40 + shift), lambda case: _run_random(cls, case))),
        ("real replicas: the score is what each cache would hit",
         lambda: _real_replicas(cls, 9 + shift)),
    ]  # fmt: skip
    return grade("Lab 9 (the precise scorer)", checks, verbose, raise_on_failure)
