"""KV cache groups: how a hybrid model's layers share one pool, and what a prefix hit is.

A hybrid model mixes layer kinds (kvlab.model.pattern): full-attention layers read every
earlier token, a sliding-window layer of W tokens reads only the last W. vLLM's hybrid KV
cache manager (docs/design/hybrid_kv_cache_manager.md; `_get_kv_cache_groups_uniform_page_size`
in vllm/v1/core/kv_cache_utils.py) splits each kind's layers into *groups* of one size,
the fewest layers any kind has. Every group has its own block table per sequence over
one shared pool, and a block of that pool holds one group's layers: layer i of each
group reads and writes pool layer i. Gemma 3's 5 : 1 pattern on 30 layers gives 1 full
group and 5 sliding groups of 5 layers each, and a block holds 5 layers' K/V.

    groups = kv_cache_groups((64, 64, 64, 64, 64, None) * 5)
    groups[0]  # KVCacheGroup(window=None, layers=(5, 11, 17, 23, 29))

A full group keeps every block of its sequence; a sliding group frees the blocks that
left its window (kvlab.cache.hybrid). A prefix hit must then be served by every group
(`cross_group_hit`): a full group needs every block of the hit, a sliding group only
the last ones its window reaches back to (vLLM's `find_longest_cache_hit`: full
attention scans from the left, sliding window from the right).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvlab.units import ceil_div


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers of one kind that share a block table: layer `layers[i]` lives in pool layer i."""

    window: int | None  # None: full attention; W: a sliding window of W tokens
    layers: tuple[int, ...]  # model layers, in order

    def blocks_needed(self, block_size: int) -> int | None:
        """Cached blocks a hit must end with for this group (None: all of them). A query
        at position p sees keys from p - W + 1 on, so a hit of h blocks needs blocks
        h - ceil((W - 1) / block_size) .. h - 1."""
        return None if self.window is None else ceil_div(self.window - 1, block_size)


def kv_cache_groups(pattern: tuple[int | None, ...]) -> list[KVCacheGroup]:
    """Layers in groups of one size (the fewest layers any kind has), full ones first.

    A kind whose layer count is not a multiple of that size ends with a smaller group;
    its missing layers are pool layers nobody uses (vLLM pads the same way). Every layer
    full gives one group of all layers: the plain paged cache."""
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(pattern):
        kinds.setdefault(window, []).append(layer)
    size = min(len(layers) for layers in kinds.values())
    order = sorted(kinds, key=lambda w: (w is not None, w or 0))  # full first, then by W
    return [
        KVCacheGroup(window, tuple(kinds[window][i : i + size]))
        for window in order
        for i in range(0, len(kinds[window]), size)
    ]


def cross_group_hit(
    groups: list[KVCacheGroup],
    cached: Callable[[int, int], bool],
    num_blocks: int,
    block_size: int,
) -> int:
    """The longest prefix hit, in blocks, that every group can serve.

    `cached(g, i)`: whether group g holds block i of the prompt (its chained key is in
    the group's index); `num_blocks`: the most blocks the hit may take. A full group
    serves a hit of h blocks when it holds blocks 0 .. h - 1; a sliding group when it
    holds the blocks its window reaches from block h back (`blocks_needed`). The hit
    shrinks until every group serves it: the full groups bound it first, then each
    sliding group moves it left to where it holds a run long enough, until none moves it.
    """
    hit = num_blocks
    for g, group in enumerate(groups):
        if group.window is None:
            hit = next((i for i in range(hit) if not cached(g, i)), hit)
    while True:
        bound = hit
        for g, group in enumerate(groups):
            if group.window is not None:
                hit = _sliding_hit(g, group.blocks_needed(block_size), cached, hit)
        if hit == bound:
            return hit


def _sliding_hit(g: int, need: int, cached: Callable[[int, int], bool], bound: int) -> int:
    """The largest h <= bound whose blocks max(0, h - need) .. h - 1 group g holds."""
    h = bound
    while h > 0:
        first = max(0, h - need)
        missing = next((i for i in range(h - 1, first - 1, -1) if not cached(g, i)), None)
        if missing is None:
            return h
        h = missing  # every hit ending past a missing block needs it: jump left of it
    return 0
