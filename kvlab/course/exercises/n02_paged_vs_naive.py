"""Notebook 02's exercises: blocks held, the watermark, a block table to fill, and first fit."""

from __future__ import annotations

from kvlab.cache.allocator import BlockAllocator
from kvlab.course.exercise import exercise
from kvlab.experiments.fragmentation import ContiguousAllocator
from kvlab.units import ceil_div


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@exercise(
    "02.paged-slots",
    question="The four doc-QA prompts are prefilled together in the paged engine's first "
    "step. How many token slots (blocks taken x 16) does the paged cache hold right after it?",
    solution="Each prompt takes ceil(tokens / 16) blocks of its own: "
    "`sum(-(-p // 16) * 16 for p in prompt_tokens)`; for prompts of 457, 519, 576 and 567 "
    "tokens, (29 + 33 + 36 + 36) x 16 = 2,144 slots (the naive cache holds 2 x 2,048 for "
    "two of them).",
    hint=lambda answer, right: (
        "a whole number of slots, e.g. the value of a sum over prompt_tokens."
        if not _is_number(answer)
        else "blocks come whole: round each prompt up to a multiple of 16, then add them up."
        if answer < right
        else "too many: a prompt of p tokens takes ceil(p / 16) blocks, no more."
    ),
    example=lambda: {"prompt_tokens": [457, 519, 576, 567], "block_size": 16},
)
def paged_slots(prompt_tokens: list[int], block_size: int) -> int:
    return sum(ceil_div(p, block_size) * block_size for p in prompt_tokens)


@exercise(
    "02.watermark-admits",
    question="Three prompts of 37, 38 and 44 tokens, 16 blocks of 8 slots, watermark "
    "admission with watermark=0.25: how many does the first step admit?",
    solution="They need 5, 5 and 6 blocks. The first is admitted alone (the watermark is "
    "waived when nothing runs): 11 blocks left. The second needs 5 and must leave "
    "int(0.25 x 16) = 4 free: 5 <= 11 - 4, admitted, 6 left. The third needs 6 > 6 - 4: "
    "it waits. 2 admitted (with the default watermark 0, all 3: 16 blocks exactly).",
    hint=lambda answer, right: (
        "the watermark keeps int(0.25 x 16) = 4 blocks free for running requests, but only "
        "once something runs: the first request is admitted alone."
        if answer < right
        else "after each admission, the blocks it took are gone; the next must fit in what "
        "is left minus the 4 watermark blocks."
    ),
    example=lambda: {
        "prompt_tokens": [37, 38, 44],
        "num_blocks": 16,
        "block_size": 8,
        "watermark": 0.25,
    },  # fmt: skip
    choices=(0, 1, 2, 3),
)
def watermark_admits(
    prompt_tokens: list[int], num_blocks: int, block_size: int, watermark: float
) -> int:
    """kvlab.cache.admission.WatermarkAdmission, for prompts arriving at once (no prefix
    cache, no chunked prefill)."""
    free, admitted = num_blocks, 0
    for tokens in prompt_tokens:
        need = ceil_div(tokens, block_size)
        headroom = int(watermark * num_blocks) if admitted else 0  # waived when alone
        if need > free - headroom:
            break
        free, admitted = free - need, admitted + 1
    return admitted


def _table_hint(answer, right) -> str:
    if not isinstance(answer, (list, tuple)) or len(answer) != len(right):
        return f"14 tokens in blocks of 4 take ceil(14 / 4) = {len(right)} blocks."
    if list(answer[: len(right) - 1]) == list(right[:-1]):
        return "right blocks first; which of A's blocks went back to the free list first?"
    return (
        "the free list hands out its oldest entries first, and a freed block joins at the "
        "back: blocks never used come before A's."
    )


@exercise(
    "02.block-table",
    question="8 blocks of 4 slots, all free. A (6-token prompt) and B (9 tokens) are "
    "admitted in step 1 and get [0, 1] and [2, 3, 4]; A finishes and its blocks are freed, "
    "last block first. C arrives with a 14-token prompt: what is its block table?",
    solution="The free list is [5, 6, 7] after step 1; A's blocks join at its back, last "
    "first: [5, 6, 7, 1, 0]. C needs ceil(14 / 4) = 4 blocks: [5, 6, 7, 1].",
    hint=_table_hint,
    example=lambda: {"num_blocks": 8, "block_size": 4, "prompt_lens": [6, 9, 14]},
    wrong=lambda right: [*right[:-1], 0],
)
def block_table(num_blocks: int, block_size: int, prompt_lens: list[int]) -> list[int]:
    """kvlab's own BlockAllocator through the story: A and B take their prompts' blocks, A
    releases its blocks tail first (PagedCache._release), C takes its prompt's blocks."""
    allocator = BlockAllocator(num_blocks)
    a_len, b_len, c_len = prompt_lens
    table_a = [allocator.allocate() for _ in range(ceil_div(a_len, block_size))]
    for _ in range(ceil_div(b_len, block_size)):  # B's blocks, which it keeps
        allocator.allocate()
    for block in reversed(table_a):
        allocator.decref(block)
    return [allocator.allocate() for _ in range(ceil_div(c_len, block_size))]


def _first_fit_hint(answer, right) -> str:
    if not isinstance(answer, (list, tuple)) or len(answer) != len(right):
        return "three answers in order, one per request: a start block, or None for a refusal."
    if answer[1] is not None:
        return (
            "E needs 4 blocks side by side. After D, list the holes' sizes: is any of them 4 "
            "long? What they add up to does not count."
        )
    if answer[0] != right[0]:
        return "first fit takes the lowest-addressed hole that is large enough, not the snuggest."
    return (
        "D takes the start of its hole and leaves the rest of it free; F takes the first hole of 2."
    )


@exercise(
    "02.first-fit",
    question="A contiguous first-fit allocator over 32 blocks holds regions [0, 6), [10, 18) "
    "and [20, 29): holes of 4, 2 and 3 blocks, 9 free. D needs 3 blocks, then E 4, then F 2, "
    "each placed (or refused) before the next: at what block does each start (None: refused)?",
    solution="First fit takes the lowest-addressed hole that is large enough. D (3) takes the "
    "hole at 6 (4 blocks) and leaves 1 block at 9. E (4) finds holes of 1, 2 and 3 blocks, 6 "
    "free in total but none of 4: refused (None), external fragmentation. F (2) takes the hole "
    "at 18. [6, None, 18]; a paged allocator would have given E any 4 of the 6 free blocks.",
    hint=_first_fit_hint,
    example=lambda: {"capacity": 32, "regions": [(0, 6), (10, 8), (20, 9)], "needs": [3, 4, 2]},
    wrong=lambda right: [None if start is None else start + 1 for start in right],
)
def first_fit(capacity: int, regions: list[tuple[int, int]], needs: list[int]) -> list[int | None]:
    """kvlab.experiments.fragmentation.ContiguousAllocator holding `regions` (start, size),
    asked for `needs` in order."""
    layout = ContiguousAllocator(capacity)
    layout.regions = dict(enumerate(regions))
    layout.check_integrity()
    return [layout.allocate(len(regions) + i, need) for i, need in enumerate(needs)]
