"""Notebook 03's exercises: what a hash hit covers, sharing within one step, forks."""

from __future__ import annotations

from kvlab.course.exercise import exercise

SAME_STEP = ("all of it", "all but the shared full blocks", "only its last token")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _hit_hint(answer, right) -> str:
    if not _is_number(answer):
        return "a number of tokens."
    if answer > right:
        return (
            "the hash index shares full blocks only: the last, partly matching block of the "
            "shared prefix is computed again."
        )
    return "every full 16-token block inside the shared prefix is found; count them."


@exercise(
    "03.b-hit-tokens",
    question="A and B share their first `shared` tokens; A's full blocks are in the hash "
    "index (blocks of 16). How many of B's prompt tokens come from the cache?",
    solution="Full blocks only: 311 shared tokens hold 19 full blocks of 16, so 19 x 16 = "
    "304 tokens hit; the 7 shared tokens of the 20th block are computed again "
    "(`shared // 16 * 16`, and never B's last prompt token, which always runs).",
    hint=_hit_hint,
    example=lambda: {"shared": 311, "block_size": 16, "prompt_len": 451},
)
def b_hit_tokens(shared: int, block_size: int, prompt_len: int) -> int:
    usable = min(shared, prompt_len - 1)  # the last prompt token runs to give logits
    return usable // block_size * block_size


@exercise(
    "03.same-step",
    question="Two requests that begin with the same preamble arrive together and are admitted "
    "in the same step, with prefix caching on. How much of its prompt does the second compute?",
    solution="All but the shared full blocks: the scheduler publishes the first request's "
    "full blocks when it schedules the step (Scheduler._publish_ahead), before the forward "
    "runs, so the second request admitted in that step finds them (as vLLM V1's "
    "allocate_slots caches blocks as it schedules them). The step's forward writes every "
    "row's K/V of a layer before any row's attention reads it. Without prefix caching, all "
    "of it.",
    hint=lambda answer, right: (
        "blocks are published when the step that computes them is scheduled, not after "
        "it runs: a request admitted later in the same step can point at them."
        if answer == SAME_STEP[0]
        else "only whole blocks are shared, and only up to where the two prompts part."
    ),
    example=lambda: {"prefix_caching": "hash"},
    choices=SAME_STEP,
)
def same_step(prefix_caching: str | None) -> str:
    return SAME_STEP[0] if prefix_caching is None else SAME_STEP[1]


@exercise(
    "03.cow-copies",
    question="n = 4 samples fork from one prompt of `prompt_len` tokens in blocks of 16. How "
    "many copy-on-write copies do they make in all?",
    solution="The prompt's last block is partly filled (333 = 20 x 16 + 13) and shared by "
    "all four; each sample's first token lands in it. Every sharer but the last to write "
    "copies it first; the last finds it no longer shared and writes in place: n - 1 = 3 "
    "copies. (With a prompt that fills its last block, the first tokens go to new blocks: "
    "no copy.)",
    hint=lambda answer, right: (
        "a number of copies."
        if not _is_number(answer)
        else "the last sample to write finds the block no longer shared: it writes in place."
        if answer > right
        else "the full blocks are only read; the partly filled last block is written by "
        "every sample."
    ),
    example=lambda: {"n": 4, "prompt_len": 333, "block_size": 16},
)
def cow_copies(n: int, prompt_len: int, block_size: int) -> int:
    return n - 1 if prompt_len % block_size else 0
