"""Notebook 14's exercises: how many blocks of a prompt a replica can hit, and what the
router's block index scores each replica for a request."""

from __future__ import annotations

from kvlab.course.exercise import exercise

BLOCK = 16  # the replicas' block size


def _blocks_hint(answer, right) -> str:
    if isinstance(answer, (int, float)) and answer > right:
        return "only full blocks are hashed, and a prompt's last token is always computed."
    return f"(prompt tokens - 1) // {BLOCK}: full blocks, the last token left to compute."


@exercise(
    "14.full-blocks",
    question="The first turn's prompt is printed above in tokens. How many of its blocks "
    "can a replica hit, at most, with 16-token blocks?",
    solution="(281 - 1) // 16 = 17: only full blocks have hashes (the partial tail has "
    "none), and the prompt's last token is always computed, to sample the first output "
    "token from; `block_hashes(ids[:-1], 16)` returns 17 hashes.",
    hint=_blocks_hint,
    example=lambda: {"ids": list(range(281))},
)
def full_blocks(ids: list[int]) -> int:
    from kvlab.cache.prefix.hash import block_hashes

    return len(block_hashes(ids[:-1], BLOCK))


CHAINS = {"r0": [1, 2, 3], "r1": [1, 2, 3, 4, 5], "r2": [1, 3, 4, 5]}  # replica -> hashes held
REQUEST = [1, 2, 3, 4, 6]  # a request's chain of block hashes


def _toy() -> dict:
    """The notebook's toy index (three replicas' events) and request, for the tests."""
    from kvlab.route.index import BlockIndex

    index = BlockIndex()
    for replica, chain in CHAINS.items():
        event = {"type": "BlockStored", "block_hashes": chain, "block_size": BLOCK}
        index.apply(replica, event)
    return {"index": index, "hashes": REQUEST}


def _scores_hint(answer, right) -> str:
    if isinstance(answer, dict) and answer.get("r2") == 3:
        return ("r2 lacks hash 2: a lookup counts blocks in a row from the first and stops "
                "at the first gap, as the engine's own lookup does.")  # fmt: skip
    if isinstance(answer, dict) and answer.get("r1") == 5:
        return "the request's 5th hash is 6, which no replica holds."
    return "per replica: how many of the request's hashes it holds, from the first, in a row."


@exercise(
    "14.router-scores",
    question="Replica r0 holds the block hashes {1, 2, 3}, r1 {1, 2, 3, 4, 5}, r2 "
    "{1, 3, 4, 5}. A request's chain is [1, 2, 3, 4, 6]. What does the index score each "
    "replica (a dict replica -> blocks)?",
    solution="{'r0': 3, 'r1': 4, 'r2': 1}: the longest run of the request's hashes from the "
    "first (`BlockIndex.longest_prefix`); r2 stops at the missing 2 although it holds 3 "
    "and 4, and no replica holds 6. The precise policy sends the request to r1.",
    hint=_scores_hint,
    example=_toy,
    wrong=lambda right: {name: len(CHAINS[name]) for name in right},
)
def router_scores(index, hashes: list[int]) -> dict[str, int]:
    return index.longest_prefix(hashes, sorted(index.blocks))
