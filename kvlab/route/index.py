"""The router's view of every replica's prefix cache: block hash -> replicas holding it.

Built from the replicas' KV events alone (vLLM's `BlockStored`, `BlockRemoved`,
`AllBlocksCleared`, as kvlab.route.events decodes them), as llm-d's precise prefix-cache
scorer and NVIDIA Dynamo's KV router keep theirs. A request's score on a replica is its
longest cached prefix there: how many of its leading block hashes the replica holds, in
a row (a block whose parent is gone can still be held, but a lookup stops at the gap, as
the engine's own does).

The index also remembers, per hash, its parent and its first tokens (for figures) and each
replica's block size, as the events say it: replicas that disagree on block size (or on
the hash seed) report hashes a router computing one kind never finds.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class BlockInfo:
    parent: int | None
    tokens: tuple[int, ...]  # the block's token ids (a figure shows the first few)


@dataclass
class BlockIndex:
    holders: dict[int, set[str]] = field(default_factory=dict)  # hash -> replicas
    blocks: dict[str, set[int]] = field(default_factory=dict)  # replica -> hashes
    info: dict[int, BlockInfo] = field(default_factory=dict)  # hash -> parent, tokens
    block_size: dict[str, int] = field(default_factory=dict)  # replica -> its block size
    counts: Counter = field(default_factory=Counter)  # (replica, event type) -> events

    def apply(self, replica: str, event: dict) -> None:
        """One decoded event map (kvlab's or vLLM's) from `replica`."""
        kind = event.get("type")
        self.counts[replica, kind] += 1
        held = self.blocks.setdefault(replica, set())
        if kind == "BlockStored":
            size = event["block_size"]
            self.block_size[replica] = size
            parent, tokens = event.get("parent_block_hash"), event.get("token_ids") or []
            for i, h in enumerate(event["block_hashes"]):
                held.add(h)
                self.holders.setdefault(h, set()).add(replica)
                chunk = tuple(tokens[i * size : (i + 1) * size])
                self.info.setdefault(h, BlockInfo(parent, chunk))
                parent = h
        elif kind == "BlockRemoved":
            for h in event["block_hashes"]:
                held.discard(h)
                self._drop(h, replica)
        elif kind == "AllBlocksCleared":
            for h in held:
                self._drop(h, replica)
            held.clear()

    def _drop(self, h: int, replica: str) -> None:
        owners = self.holders.get(h)
        if owners is None:
            return
        owners.discard(replica)
        if not owners:
            del self.holders[h]
            self.info.pop(h, None)

    def longest_prefix(self, hashes: list[int], replicas: list[str]) -> dict[str, int]:
        """Per replica, how many of `hashes` (a request's chain) it holds from the first
        on without a gap."""
        matched = dict.fromkeys(replicas, 0)
        alive = set(replicas)
        for h in hashes:
            alive &= self.holders.get(h, set())
            if not alive:
                break
            for replica in alive:
                matched[replica] += 1
        return matched

    def size(self, replica: str) -> int:
        """Blocks `replica` holds, as its events tell."""
        return len(self.blocks.get(replica, ()))

    def forget(self, replica: str) -> None:
        """Drop what is known of `replica` (it restarted, or events were lost)."""
        self.apply(replica, {"type": "AllBlocksCleared"})
