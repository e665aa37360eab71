"""Notebook 16's exercises: how a pattern's layers form KV cache groups, the prefix hit
every group can serve, and which dropped window blocks a retention interval keeps cached."""

from __future__ import annotations

from types import SimpleNamespace

from kvlab.course.exercise import exercise

LAYERS = 30  # SmolLM2-135M's layers
PATTERN = "window=32*3,full"  # Gemma 2's 1:1 would be "window=32,full"


def _groups_hint(answer, right) -> str:
    if isinstance(answer, (list, tuple)) and len(answer) == 2 and answer[1] != right[1]:
        return ("count each kind's layers over all 30 (the 4-layer unit repeats 7 times and "
                "a half): the group size is the fewest layers any kind has.")  # fmt: skip
    return ("a kind with L layers gives ceil(L / size) groups, the last one smaller when "
            "size does not divide L; add the kinds' groups.")  # fmt: skip


@exercise(
    "16.groups",
    question=f"With attention_pattern={PATTERN!r} on SmolLM2's {LAYERS} layers, how many KV "
    "cache groups are there, and how many layers does one block of the pool hold? (a list "
    "[groups, layers per block])",
    solution="[5, 7]: the unit (3 window layers, 1 full) repeats over 30 layers, so 7 are "
    "full (3, 7, ..., 27) and 23 slide. Groups take the fewest layers any kind has, 7: "
    "one full group of 7, and the 23 sliding layers in groups of 7, 7, 7 and 2. A block "
    "holds 7 layers' K/V, and the last group leaves 5 of its 7 pool layers unused "
    "(`kv_cache_groups(parse_pattern('window=32*3,full', 30))`).",
    hint=_groups_hint,
    example=lambda: {"pattern": PATTERN, "layers": LAYERS},
    wrong=lambda right: [right[0] + 1, right[1]],
)
def groups(pattern: str, layers: int) -> list[int]:
    from kvlab.cache.groups import kv_cache_groups
    from kvlab.model.pattern import parse_pattern

    found = kv_cache_groups(parse_pattern(pattern, layers))
    return [len(found), max(len(g.layers) for g in found)]


HELD = {"full": list(range(12)), "window 32": [0, 1, 2, 5, 6, 8, 10]}  # blocks each group holds
NUM_BLOCKS = 12  # the most blocks the hit may take


def _hit_example() -> dict:
    from kvlab.cache.groups import KVCacheGroup

    groups = [KVCacheGroup(None, (1,)), KVCacheGroup(32, (0,))]
    return {"groups": groups, "held": HELD, "num_blocks": NUM_BLOCKS, "block_size": 16}


def _hit_hint(answer, right) -> str:
    if answer == 0:
        return "the window holds two blocks in a row (5 and 6): a hit ending just after them works."
    if isinstance(answer, int) and answer > right:
        return ("a window of 32 tokens in blocks of 16 needs the 2 blocks just before the hit: "
                "both held. Move left past each missing block.")  # fmt: skip
    return "try h = 12, 11, ... in turn: the first h whose blocks h-2 and h-1 the window holds."


@exercise(
    "16.hit",
    question="Blocks of 16, two groups: a full one holding blocks 0-11, a window of 32 "
    "tokens holding blocks 0, 1, 2, 5, 6, 8 and 10. The prompt allows a hit of at most 12 "
    "blocks. How many blocks does `cross_group_hit` return?",
    solution="7: the full group allows 12. The window needs ceil((32 - 1) / 16) = 2 blocks "
    "before the hit: h = 12 needs 10 and 11 (11 missing), h = 11 needs 9 and 10 (9 "
    "missing), h = 9 needs 7 and 8 (7 missing), h = 7 needs 5 and 6: held. The full group "
    "serves 7 too, so 7 blocks (112 tokens) hit; blocks 0-4 of the window group are not "
    "read.",
    hint=_hit_hint,
    example=_hit_example,
)
def hit(groups, held: dict, num_blocks: int, block_size: int) -> int:
    from kvlab.cache.groups import cross_group_hit

    sets = [set(blocks) for blocks in held.values()]
    return cross_group_hit(groups, lambda g, i: i in sets[g], num_blocks, block_size)


def _kept_hint(answer, right) -> str:
    if isinstance(answer, (list, tuple)) and len(answer) > len(right):
        return ("only blocks a hit at a multiple of the interval reads: a hit of 4 blocks "
                "reads the window's 2 blocks before it.")  # fmt: skip
    return "the hits may land at 64, 128 tokens (blocks 4 and 8); which blocks do they read?"


@exercise(
    "16.interval-kept",
    question="A window of 32 tokens, blocks of 16, prefix_cache_retention_interval=64. Of "
    "a sliding group's blocks 0-7, which stay cached once the window drops them? (a list)",
    solution="[2, 3, 6, 7]: hits may land at multiples of 64 tokens, 4 blocks; a hit of 4 "
    "blocks reads the window's 2 blocks before it (2 and 3), a hit of 8 reads 6 and 7. "
    "Blocks 0, 1, 4 and 5 go back to the free list (`GroupTables.checkpoint`).",
    hint=_kept_hint,
    example=lambda: {"window": 32, "block_size": 16, "interval": 64},
    wrong=lambda right: list(range(8)),
)
def interval_kept(window: int, block_size: int, interval: int) -> list[int]:
    from kvlab.cache.groups import KVCacheGroup
    from kvlab.cache.hybrid import GroupTables

    part = SimpleNamespace(interval=interval, block_size=block_size,
                           group=KVCacheGroup(window, (0,)))  # fmt: skip
    return [i for i in range(8) if GroupTables.checkpoint(part, i)]
