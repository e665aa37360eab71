"""KV events: what a cache tells the world it stores and removes, in vLLM's terms.

vLLM's block pool reports each change of its prefix cache (vllm/distributed/kv_events.py):
`BlockStored` (full blocks became reusable, with their chained hashes, the parent's hash
and their token ids), `BlockRemoved` (an evicted block's hash) and `AllBlocksCleared` (the
prefix cache was reset). Routers (llm-d's precise scorer, NVIDIA Dynamo's KV router) keep
a block-hash -> replicas index from them. kvlab's hash index reports the same changes
through an `EventSink` it is given when built, a plain callable; the serve layer
(kvlab.serve.kv_events) turns them into vLLM's wire format and publishes them over ZMQ.

Hashes here are the index's own bytes (32 for sha256_cbor, vLLM's; 16 for blake2b);
`extra_keys` is one entry per block: None, or the untagged values the block's hash took
besides its tokens (the cache salt), as vLLM's events carry them; `group_idx` names the
KV cache group of a hybrid model whose index changed (kvlab.cache.groups; 0 otherwise).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[bytes]  # the new blocks, in chain order
    parent_block_hash: bytes | None  # the block before the first (None: it starts a prompt)
    token_ids: list[int]  # len(block_hashes) * block_size tokens
    block_size: int
    extra_keys: list[tuple | None]  # per block: None or (salt,)
    group_idx: int = 0  # the KV cache group whose index stored them (kvlab.cache.hybrid)


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[bytes]
    group_idx: int = 0


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
EventSink = Callable[[KVEvent], None]  # called on the engine's thread, in order


class EventLog:
    """An EventSink that keeps what it is told (tests, notebooks): `take()` hands over
    the events since the last call, in order."""

    def __init__(self) -> None:
        self.events: list[KVEvent] = []

    def __call__(self, event: KVEvent) -> None:
        self.events.append(event)

    def take(self) -> list[KVEvent]:
        taken, self.events = self.events, []
        return taken
