"""Where a request goes: the router's policies, each a registered class (`POLICIES`).

    round-robin    replicas in turn, blind to load and cache
    least-loaded   the replica with the fewest requests in flight (from this router)
    approx-prefix  llm-d's approximate prefix-cache scorer: chained hashes of 64-character
                   blocks of the prompt, and an LRU per replica of the blocks this router
                   sent there; no tokenizer, no events, a guess of what is cached
    precise        llm-d's precise scorer / Dynamo's KV router: the request's vLLM block
                   hashes (its token ids, the replicas' block size and seed) looked up in
                   the block-hash -> replicas index the replicas' KV events keep
                   (kvlab.route.index); the longest cached prefix wins

The prefix policies carry a load guard: only replicas with at most `load_guard` more
requests in flight than the least busy one compete on prefix; a replica holding the
prefix but further behind loses to a cold one (a hot prefix would otherwise pile every
request on one replica). Ties (e.g. nothing cached anywhere) go to the least loaded
replica, then the one sent the fewest requests so far, then the first.

Each `choose` returns a `Decision`: the replica, a short reason, and the score per
replica it compared (the figures show why a request went where it went).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass, field

from kvlab.registry import Registry
from kvlab.route.hashing import char_block_hashes, token_block_hashes
from kvlab.route.index import BlockIndex


@dataclass
class Replica:
    """A backend as the router sees it."""

    name: str
    url: str
    in_flight: int = 0  # requests sent and not finished
    routed: int = 0  # requests sent so far


@dataclass
class RoutedRequest:
    """What a policy may look at: the prompt as text (always) and as token ids (when the
    router has them: token-id prompts, or prompts it tokenized), and the cache salt."""

    text: str
    token_ids: list[int] | None = None
    salt: str | None = None
    user: str | None = None  # OpenAI's `user` field (for the decision log only)


@dataclass
class Decision:
    replica: str
    reason: str
    scores: dict[str, float] = field(default_factory=dict)  # what was compared, per replica
    blocks: int = 0  # the request's hashable blocks (prefix policies)


class Policy(ABC):
    name: str | None = None  # set by POLICIES.register

    def __init__(self, load_guard: int = 2, **options):
        self.load_guard = load_guard

    @abstractmethod
    def choose(self, request: RoutedRequest, replicas: list[Replica]) -> Decision: ...

    def routed(self, request: RoutedRequest, replica: Replica) -> None:  # noqa: B027
        """The request went to `replica` (the approximate policy records it)."""

    @staticmethod
    def least_loaded(replicas: list[Replica]) -> Replica:
        return min(replicas, key=lambda r: (r.in_flight, r.routed))

    def by_prefix(self, scores: dict[str, int], replicas: list[Replica], blocks: int, what: str):
        """The best prefix among the replicas the load guard lets compete."""
        floor = min(r.in_flight for r in replicas)
        fair = [r for r in replicas if r.in_flight <= floor + self.load_guard]
        best = max(scores[r.name] for r in fair)
        if best == 0:
            choice = self.least_loaded(fair)
            reason = f"no {what} cached: least loaded"
        else:
            choice = self.least_loaded([r for r in fair if scores[r.name] == best])
            reason = f"{best}/{blocks} {what} cached"
        top = max(scores.values())
        if top > best:
            reason += f" (load guard: a replica with {top} is > {self.load_guard} busier)"
        return Decision(choice.name, reason, {k: float(v) for k, v in scores.items()}, blocks)


POLICIES: Registry[type[Policy]] = Registry("routing policy", "policy")


@POLICIES.register("round-robin")
class RoundRobin(Policy):
    def __init__(self, **options):
        super().__init__(**options)
        self.next = 0

    def choose(self, request, replicas):
        replica = replicas[self.next % len(replicas)]
        self.next += 1
        return Decision(replica.name, "in turn")


@POLICIES.register("least-loaded")
class LeastLoaded(Policy):
    def choose(self, request, replicas):
        replica = self.least_loaded(replicas)
        scores = {r.name: float(r.in_flight) for r in replicas}
        return Decision(replica.name, f"fewest in flight ({replica.in_flight})", scores)


@POLICIES.register("approx-prefix")
class ApproxPrefix(Policy):
    """What this router sent where, per 64-character block (llm-d's approximate mode:
    hashBlockSize 64 characters, an LRU of lruCapacityPerServer 31250 blocks per replica)."""

    def __init__(self, block_chars: int = 64, capacity_blocks: int = 31250, **options):
        super().__init__(**options)
        self.block_chars, self.capacity = block_chars, capacity_blocks
        self.sent: dict[str, OrderedDict[int, None]] = {}  # replica -> LRU of block hashes

    def _hashes(self, request: RoutedRequest) -> list[int]:
        return char_block_hashes(request.text, self.block_chars, request.salt)

    def choose(self, request, replicas):
        hashes = self._hashes(request)
        scores = {}
        for r in replicas:
            lru, n = self.sent.get(r.name, {}), 0
            for h in hashes:
                if h not in lru:
                    break
                n += 1
            scores[r.name] = n
        return self.by_prefix(scores, replicas, len(hashes), "char blocks")

    def routed(self, request, replica):
        lru = self.sent.setdefault(replica.name, OrderedDict())
        for h in self._hashes(request):
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > self.capacity:
            lru.popitem(last=False)


@POLICIES.register("precise")
class Precise(Policy):
    """The longest cached prefix per replica, from the replicas' KV events."""

    def __init__(
        self, index: BlockIndex | None = None, block_size: int | None = None,
        hash_seed: str | None = None, **options,
    ):  # fmt: skip
        super().__init__(**options)
        self.index = index if index is not None else BlockIndex()
        self.block_size, self.hash_seed = block_size, hash_seed

    def _block_size(self, replicas: list[Replica]) -> int | None:
        """The configured block size, else the one the replicas' events report."""
        if self.block_size:
            return self.block_size
        sizes = [self.index.block_size[r.name] for r in replicas if r.name in self.index.block_size]
        return sizes[0] if sizes else None

    def choose(self, request, replicas):
        size = self._block_size(replicas)
        if request.token_ids is None or size is None:
            replica = self.least_loaded(replicas)
            why = "no token ids" if request.token_ids is None else "no events yet"
            return Decision(replica.name, f"{why}: least loaded")
        hashes = token_block_hashes(request.token_ids, size, request.salt, self.hash_seed)
        scores = self.index.longest_prefix(hashes, [r.name for r in replicas])
        return self.by_prefix(scores, replicas, len(hashes), "blocks")
