"""Sessions: a conversation's requests, and freeing its KV blocks on every tier when it ends.

A request joins a session with `engine.add_request(..., session="user-7")`. The engine
remembers the token prefixes each session's finished requests left cached (with their
salt). `engine.end_session("user-7")` cancels the session's unfinished requests and frees
its blocks everywhere: cached (unreferenced) device blocks go back to the free list, and
host / disk tier copies are deleted. A block another live session also reached (a shared
system prompt) stays. With `EngineConfig.session_ttl_s`, a session idle that long (no
unfinished request, its last one finished that many seconds ago on the engine clock) is
ended at the next step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvlab.cache.prefix.hash import HashPrefixIndex
from kvlab.engine.sequence import Sequence

if TYPE_CHECKING:
    from kvlab.engine.engine import Engine

Prefix = tuple[tuple[int, ...], str | None]  # token ids, salt


@dataclass
class SessionRecord:
    prefixes: list[Prefix] = field(default_factory=list)  # what its requests left cached
    live: set[int] = field(default_factory=set)  # unfinished request ids
    last_active_s: float = 0.0  # engine clock of its last add or finish


@dataclass(frozen=True)
class SessionEnd:
    """What ending a session freed: blocks per tier ("device" included), requests cancelled."""

    session_id: str
    freed: dict[str, int]
    cancelled: int
    reason: str  # "ended" (end_session) or "ttl"


class Sessions:
    """The engine's record of sessions (see the module docstring)."""

    def __init__(self, ttl_s: float | None):
        self.ttl_s = ttl_s
        self.records: dict[str, SessionRecord] = {}
        self.ended: list[SessionEnd] = []

    def on_add(self, seq: Sequence, now: float) -> None:
        if seq.session is None:
            return
        record = self.records.setdefault(seq.session, SessionRecord())
        record.live.add(seq.request_id)
        record.last_active_s = now

    def on_finish(self, seq: Sequence, now: float) -> None:
        record = self.records.get(seq.session) if seq.session is not None else None
        if record is None:
            return
        record.live.discard(seq.request_id)
        record.last_active_s = now
        # Every token it ever held, not only those computed now: a request preempted by
        # recompute (num_computed 0) has published blocks all the same.
        tokens = tuple(seq.token_ids)
        if tokens:  # keep only prefixes no longer one is an extension of
            kept = [
                p for p in record.prefixes if not (p[1] == seq.salt and tokens[: len(p[0])] == p[0])
            ]
            if not any(p[1] == seq.salt and p[0][: len(tokens)] == tokens for p in kept):
                kept.append((tokens, seq.salt))
            record.prefixes = kept

    def expire(self, engine: Engine, now: float) -> list[SessionEnd]:
        """End every session idle longer than the TTL."""
        if self.ttl_s is None:
            return []
        idle = [sid for sid, r in self.records.items()
                if not r.live and now - r.last_active_s > self.ttl_s]  # fmt: skip
        return [self.end(engine, sid, reason="ttl") for sid in idle]

    def end(self, engine: Engine, session_id: str, reason: str = "ended") -> SessionEnd:
        """Cancel the session's unfinished requests and free its blocks on every tier."""
        if session_id not in self.records:
            raise ValueError(f"session_id={session_id!r} is unknown (or has ended already)")
        cancelled = sum(engine.cancel(rid) for rid in sorted(self.records[session_id].live))
        record = self.records.pop(session_id)
        freed: dict[str, int] = {"device": 0}
        cache = engine.cache
        if getattr(cache, "index", None) is not None:
            keyer = HashPrefixIndex(cache.block_size)
            keep = {
                k
                for r in self.records.values()
                for t, s in r.prefixes
                for k in keyer.keys(list(t), s)
            }
            connector = getattr(cache, "connector", None)
            by_key = getattr(cache.index, "block_of", None)  # hash: every indexed key
            for tokens, salt in record.prefixes:
                keys = keyer.keys(list(tokens), salt)
                blocks = [by_key.get(k) for k in keys] if by_key is not None else (
                    cache.index.match(list(tokens), salt).blocks)  # fmt: skip
                for i, key in enumerate(keys):
                    if key in keep:
                        continue
                    block = blocks[i] if i < len(blocks) else None
                    if block is not None and block in cache.allocator.cached:
                        cache._forget(block)
                        if block in cache.allocator.cached:
                            cache.allocator.uncache(block)
                        freed["device"] += 1
                    if connector is not None:
                        for tier in connector.discard(key):
                            freed[tier] = freed.get(tier, 0) + 1
        end = SessionEnd(session_id, freed, cancelled, reason)
        self.ended.append(end)
        return end
