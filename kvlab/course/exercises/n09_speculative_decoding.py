"""Notebook 09's exercises: what a verified row emits, and what its rollback returns."""

from __future__ import annotations

from kvlab.course.exercise import exercise


def _row() -> dict:
    return {"drafts": [11, 42, 7, 93], "target": [11, 42, 8, 93, 5]}


def _emit_hint(answer, right) -> str:
    answer = list(answer) if isinstance(answer, (list, tuple)) else answer
    if answer == right[:-1]:
        return (
            "the accepted drafts, and then one more: the model's own token at the first "
            "row that disagrees (every verified row emits at least one token)."
        )
    if isinstance(answer, list) and len(answer) > len(right):
        return (
            "acceptance stops at the first draft the model disagrees with, even if a "
            "later one happens to match."
        )
    return "walk the rows: accept draft i while it equals row i's argmax; then emit that row's."


@exercise(
    "09.greedy-emit",
    question="A row carries drafts `drafts`; the verify forward's argmax at each of its "
    "len(drafts) + 1 positions is `target` (row 0 predicts the token after the pending one). "
    "Which tokens does the row emit, in order (a list)?",
    solution="Accept drafts while each equals its row's argmax, then emit the argmax of the "
    "first row that disagrees (or of the last row when all are accepted). For drafts "
    "[11, 42, 7, 93] and argmaxes [11, 42, 8, 93, 5]: [11, 42, 8]; the 4th draft matches "
    "but comes after a rejection, so it is not used (`accept_greedy`).",
    hint=_emit_hint,
    example=_row,
    wrong=lambda right: right[:-1],
)
def greedy_emit(drafts: list[int], target: list[int]) -> list[int]:
    import torch

    from kvlab.speculative.verify import accept_greedy

    logits = torch.full((len(target), max(target) + 1), -1.0)
    logits[torch.arange(len(target)), torch.tensor(target)] = 1.0
    return accept_greedy(logits, list(drafts))


def _event() -> dict:
    from kvlab.speculative.speculator import SpecEvent

    # pending token at 9, drafts at 10-13 (blocks 0-3 of 4 slots); 1 accepted: 0-10 kept
    event = SpecEvent(2, 1, 9, [5, 6, 7, 8], 1, [20, 21, 22, 23], [20, 21, 22])
    return {"event": event, "block_size": 4}


def _rollback_hint(answer, right) -> str:
    if answer == 0:
        return (
            "count the slots: while verifying, the row holds positions pending .. "
            "pending + drafts; after, it keeps pending .. pending + accepted (the next "
            "step computes the token the row emitted last)."
        )
    return (
        "blocks while verifying: ceil((position + 1 + drafts) / block_size); kept: "
        "ceil((position + 1 + accepted) / block_size); the rest are returned."
    )


@exercise(
    "09.rollback-blocks",
    question="The first verified row: its pending token at `event.position`, "
    "`len(event.drafts)` drafts, `event.accepted` accepted, blocks of `block_size` slots. "
    "How many blocks does the rollback return to the free list?",
    solution="While verifying the row's K/V fill positions 0 .. position + drafts, "
    "ceil((position + 1 + drafts) / block_size) blocks; after it, positions 0 .. position + "
    "accepted are kept, ceil((position + 1 + accepted) / block_size) blocks; the difference "
    "goes back (`KVCache.rewind`). For position 741, 4 drafts, 1 accepted, blocks of 4: "
    "187 - 186 = 1.",
    hint=_rollback_hint,
    example=_event,
)
def rollback_blocks(event, block_size: int) -> int:
    return len(event.table) - len(event.kept)
