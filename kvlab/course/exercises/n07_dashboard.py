"""Notebook 07's exercises: what prefix caching saves on the workload, and what int8 KV
buys with the same bytes."""

from __future__ import annotations

from kvlab.course.exercise import exercise


def shared_prefix(prompts: list[list[int]]) -> int:
    """Tokens every prompt starts with (the longest common prefix of the token ids)."""
    first, n = prompts[0], 0
    while n < len(first) and all(len(p) > n and p[n] == first[n] for p in prompts):
        n += 1
    return n


def _doc_qa_like() -> dict:
    from kvlab.workloads import Request

    # four prompts that share their first 40 tokens, then differ
    prompts = [list(range(40)) + [100 + i] * (5 + i) for i in range(4)]
    return {"requests": [Request(p, 4) for p in prompts], "block_size": 16}


def _hit_hint(answer, right) -> str:
    if not isinstance(answer, (int, float)):
        return "a share: hit tokens / prompt tokens, a number between 0 and 1."
    if answer > right * 1.2:
        return (
            "too high: only whole blocks are shared (round the preamble down to 16s), "
            "and the first request has nothing to hit: it computes the preamble."
        )
    return "(requests - 1) x (shared tokens rounded down to whole blocks) / all prompt tokens."


@exercise(
    "07.hit-rate",
    question="With hash prefix caching (whole 16-token blocks, as vLLM), what share of the "
    "workload's prompt tokens will `paged+prefix` serve from the cache instead of computing? "
    "The prompts' lengths and the tokens they all share are printed above. Compute it.",
    solution="Only whole blocks of the shared preamble can hit, and the first request has "
    "nothing to hit: (n - 1) x floor(shared / 16) x 16 / sum(prompt tokens). On the "
    "notebook's four doc-QA prompts: 3 x 304 / 2,119 = 0.4304, the table's prefix_hit_rate.",
    hint=_hit_hint,
    example=_doc_qa_like,
    tolerance=2e-3,
)
def hit_rate(requests, block_size: int) -> float:
    prompts = [list(r.prompt) for r in requests]
    whole = shared_prefix(prompts) // block_size * block_size
    return (len(prompts) - 1) * whole / sum(map(len, prompts))


def _budget() -> dict:
    import torch

    from kvlab.cache.spec import KVSpec

    spec = KVSpec(num_layers=30, num_kv_heads=3, head_dim=64)
    return {"budget": 1024 * 46_080, "spec": spec, "dtype": torch.float32, "block_size": 16}


def _blocks_hint(answer, right) -> str:
    if right < answer <= right * 1.05:  # 64 / 66 of the bytes: no scales
        return (
            "a few too many: exactly 4x the fp32 blocks forgets the scales: int8 "
            "stores a bf16 scale per token per head beside each K and V row."
        )
    if answer > 1000:
        return "that counts token slots: the cache hands out blocks of 16."
    return (
        "budget // (2 x layers x KV heads x (head_dim x 1 byte + 2 bytes of scale)), "
        "then // 16 for whole blocks."
    )


@exercise(
    "07.int8-blocks",
    question="The budget holds 64 blocks of 16 fp32 tokens. How many 16-token blocks does "
    "the same budget (in bytes) hold with `int8` K/V, a bf16 scale per token per head "
    "included? Compute it from `budget` and the model's shape.",
    solution="int8 stores per token 2 x 30 layers x 3 KV heads x (64 codes + 2 bytes of "
    "scale) = 11,880 bytes; 47,185,920 // 11,880 = 3,971 slots, 248 whole blocks (3.9x "
    "the 64 fp32 blocks; exactly 4x without the scales).",
    hint=_blocks_hint,
    example=_budget,
)
def int8_blocks(budget: int, spec, dtype, block_size: int) -> int:
    from kvlab.cache.codecs import CODECS

    return budget // CODECS["int8"].token_bytes(spec, dtype) // block_size
