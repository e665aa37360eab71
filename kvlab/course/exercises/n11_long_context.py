"""Notebook 11's exercises: which blocks a sinks + window policy keeps, and which position a
query gets when the cache renumbers (StreamingLLM) or keeps the text's (kvlab)."""

from __future__ import annotations

from kvlab.config import EngineConfig
from kvlab.course.exercise import exercise

KEPT_AFTER = 160  # tokens computed when the block table of 11.sinks-kept is read


def _sliding() -> dict:
    """Notebook 11's block-map config (sinks 16, window 64, blocks of 16), for the tests."""
    config = EngineConfig(cache="paged", retention="sinks", retention_sinks=16,
                          retention_window=64)  # fmt: skip
    return {"config": config}


def _kept_hint(answer, right) -> str:
    if isinstance(answer, (list, tuple)) and 0 not in answer and 0 in right:
        return "the sinks: the policy keeps the first retention_sinks tokens' block(s) too."
    if isinstance(answer, (list, tuple)) and answer and max(answer) < max(right):
        return "count the blocks of all 160 tokens: the last one is 160 // 16 - 1."
    return ("the window keeps every block from (160 - retention_window) // block_size on; "
            "the sinks keep the first ceil(retention_sinks / block_size) blocks.")  # fmt: skip


@exercise(
    "11.sinks-kept",
    question="With sinks of 16 tokens, a window of 64 and blocks of 16, which logical blocks "
    f"of a sequence are still in its table after {KEPT_AFTER} tokens are computed? (a list "
    "of logical block numbers, in order)",
    solution="[0, 6, 7, 8, 9]: the sink block 0, and the blocks from (160 - 64) // 16 = 6 "
    "to the last, 160 // 16 - 1 = 9; blocks 1-5 went back to the free list "
    "(`SinksRetention.drop`; the map's row 160 shows it).",
    hint=_kept_hint,
    example=_sliding,
    wrong=lambda right: [b for b in right if b != 0],
)
def sinks_kept(config: EngineConfig) -> list[int]:
    from kvlab.cache.retention import RETENTION

    policy = RETENTION[config.retention].from_config(config, num_blocks=64)
    table = list(range(KEPT_AFTER // config.block_size))
    dropped = set(policy.drop(table, KEPT_AFTER))
    return [i for i in table if i not in dropped]


def _position_hint(answer, right) -> str:
    if answer == 9:
        return (
            "9 is its position in the text (what kvlab gives it); StreamingLLM counts "
            "positions inside the cache."
        )
    return "number the cached tokens 0, 1, 2, ... in cache order: the new token comes next."


@exercise(
    "11.streaming-position",
    question="StreamingLLM's example: the cache holds the tokens at text positions "
    "[0, 1, 2, 3, 6, 7, 8] and token 9 is being decoded. Which position does StreamingLLM "
    "give the new token's query?",
    solution="7: StreamingLLM numbers positions inside the cache (the 7 cached tokens get "
    "0-6, the new one 7), so no relative distance exceeds the cache size; kvlab keeps the "
    "text's positions (9), as its keys are stored already rotated.",
    hint=_position_hint,
    example=lambda: {"kept": [0, 1, 2, 3, 6, 7, 8]},
)
def streaming_position(kept: list[int]) -> int:
    return len(kept)
