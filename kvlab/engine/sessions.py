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

from collections.abc import Callable
from dataclasses import dataclass, field

from kvlab.cache.base import KVCache
from kvlab.cache.prefix.hash import HashPrefixIndex
from kvlab.sequence import Sequence

Prefix = tuple[tuple[int, ...], str | None]  # token ids, salt
Cancel = Callable[[int], bool]  # cancels a request by id (Engine.cancel)


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

    def expire(self, now: float, cancel: Cancel, cache: KVCache) -> list[SessionEnd]:
        """End every session idle longer than the TTL."""
        if self.ttl_s is None:
            return []
        idle = [sid for sid, r in self.records.items()
                if not r.live and now - r.last_active_s > self.ttl_s]  # fmt: skip
        return [self.end(sid, cancel, cache, reason="ttl") for sid in idle]

    def end(self, session_id: str, cancel: Cancel, cache: KVCache, reason: str = "ended"):
        """Cancel the session's unfinished requests and free its blocks on every tier."""
        if session_id not in self.records:
            raise ValueError(f"session_id={session_id!r} is unknown (or has ended already)")
        cancelled = sum(cancel(rid) for rid in sorted(self.records[session_id].live))
        record = self.records.pop(session_id)
        keyer = cache.index  # the hash index's own keys (algo, seed); else the default's
        keyer = keyer if isinstance(keyer, HashPrefixIndex) else HashPrefixIndex(cache.block_size)
        keep = {
            key
            for other in self.records.values()
            for tokens, salt in other.prefixes
            for key in keyer.keys(list(tokens), salt)
        }
        freed = cache.forget_prefixes(record.prefixes, keep)
        end = SessionEnd(session_id, freed, cancelled, reason)
        self.ended.append(end)
        return end
