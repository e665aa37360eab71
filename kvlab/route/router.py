"""The router's state: its backends, the policy in force, the block index its KV-event
subscriber keeps, and a log of every decision (kvlab.route.app serves it over HTTP)."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from kvlab.route.events import EventSubscriber
from kvlab.route.index import BlockIndex
from kvlab.route.policies import POLICIES, Decision, Policy, Replica, RoutedRequest


@dataclass(frozen=True)
class Backend:
    """An OpenAI-compatible server (kvlab serve, vllm serve) and, if it publishes them,
    where its KV events are (`events`: the PUB endpoint; `replay`: its replay endpoint)."""

    url: str
    events: str | None = None
    replay: str | None = None
    topic: str = ""
    name: str | None = None

    @classmethod
    def parse(cls, text: str, i: int) -> Backend:
        """`URL[,events=tcp://...][,replay=tcp://...][,topic=T][,name=N]`."""
        url, *options = text.split(",")
        fields = {}
        for option in options:
            key, sep, value = option.partition("=")
            if not sep or key not in ("events", "replay", "topic", "name"):
                raise ValueError(f"--backend {text!r}: options are events=, replay=, topic=, name=")
            fields[key] = value
        fields.setdefault("name", f"r{i}")
        return cls(url.rstrip("/"), **fields)


def make_policy(name: str, index: BlockIndex, **options) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"routing policy {name!r} is unknown; choose one of {POLICIES.names()}")
    if name == "precise":
        return POLICIES[name](index=index, **options)
    options.pop("block_size", None), options.pop("hash_seed", None)
    return POLICIES[name](**options)


class Router:
    """Backends, a policy, the events index. `choose` and `finished` are thread-safe."""

    def __init__(
        self,
        backends: list[Backend],
        policy: str = "precise",
        tokenizer=None,
        load_guard: int = 2,
        block_size: int | None = None,
        hash_seed: str | None = None,
        keep_decisions: int = 10_000,
    ):
        if not backends:
            raise ValueError("the router needs at least one backend")
        names = [b.name for b in backends]
        if len(set(names)) != len(names):
            raise ValueError(f"backend names must differ: {names}")
        self.backends = {b.name: b for b in backends}
        self.replicas = [Replica(b.name, b.url) for b in backends]
        self.tokenizer = tokenizer
        self.options = {"load_guard": load_guard, "block_size": block_size, "hash_seed": hash_seed}
        self.index = BlockIndex()
        self.subscriber: EventSubscriber | None = None
        if any(b.events for b in backends):
            self.subscriber = EventSubscriber(self.index.apply)
            for b in backends:
                if b.events:
                    self.subscriber.add(b.name, b.events, b.replay, b.topic)
        self._lock = threading.Lock()
        self.decisions: deque[dict] = deque(maxlen=keep_decisions)
        self.count = 0
        self.set_policy(policy)

    def set_policy(self, name: str, **options) -> None:
        """Switch policy (approx-prefix starts with an empty memory)."""
        policy = make_policy(name, self.index, **{**self.options, **options})
        with self._lock:
            self.policy = policy

    def start(self) -> Router:
        if self.subscriber is not None:
            self.subscriber.start()
        return self

    def stop(self) -> None:
        if self.subscriber is not None:
            self.subscriber.stop()

    def choose(self, request: RoutedRequest) -> tuple[Replica, dict]:
        """The replica for `request` (counted in flight until `finished`), and the log
        entry of the decision."""
        index_lock = self.subscriber.lock if self.subscriber else threading.Lock()
        with self._lock, index_lock:
            decision: Decision = self.policy.choose(request, self.replicas)
            replica = next(r for r in self.replicas if r.name == decision.replica)
            entry = {
                "i": self.count,
                "t": time.time(),
                "policy": self.policy.name,
                "user": request.user,
                "replica": replica.name,
                "reason": decision.reason,
                "scores": decision.scores,
                "blocks": decision.blocks,
                "prompt_tokens": None if request.token_ids is None else len(request.token_ids),
                "in_flight": {r.name: r.in_flight for r in self.replicas},
            }
            self.count += 1
            replica.in_flight += 1
            replica.routed += 1
            self.policy.routed(request, replica)
            self.decisions.append(entry)
        return replica, entry

    def finished(self, replica: Replica, entry: dict, ttfb_s: float | None, status: int) -> None:
        with self._lock:
            replica.in_flight -= 1
            entry["ttfb_s"], entry["status"] = ttfb_s, status

    def state(self) -> dict:
        with self._lock:
            replicas = [
                {
                    "name": r.name,
                    "url": r.url,
                    "in_flight": r.in_flight,
                    "routed": r.routed,
                    "index_blocks": self.index.size(r.name),
                    "block_size": self.index.block_size.get(r.name),
                }
                for r in self.replicas
            ]
        feeds = {}
        if self.subscriber is not None:
            for name, f in self.subscriber.feeds.items():
                feeds[name] = {"batches": f.batches, "events": f.events, "gaps": f.gaps}
        return {"policy": self.policy.name, "replicas": replicas, "events": feeds}

    def reset_counts(self) -> None:
        """Forget decisions and per-replica counts (between benchmark rounds)."""
        with self._lock:
            self.decisions.clear()
            for r in self.replicas:
                r.routed = 0
