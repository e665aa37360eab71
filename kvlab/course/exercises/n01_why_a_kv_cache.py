"""Notebook 01's exercises: the work a cache saves, and what one token of cache costs."""

from __future__ import annotations

from kvlab.cache.spec import KVSpec
from kvlab.course.exercise import exercise

GIB = 2**30


def _smollm2() -> dict:
    """SmolLM2-135M's shape (30 layers, 3 KV heads of 64), for the tests."""
    return {"spec": KVSpec(num_layers=30, num_kv_heads=3, head_dim=64)}


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _positions_hint(answer, right) -> str:
    if not _is_number(answer):
        return "a whole number: the value of an expression in len(prompt_ids) and new_tokens."
    if answer < right / 4:
        return (
            "about what the model runs *with* the cache; without it, every forward runs "
            "over the whole sequence so far."
        )
    if answer > right:
        return (
            "too many: the first forward runs over the prompt alone (P tokens), the next "
            "over P + 1, and the last over P + N - 1."
        )
    return (
        "too few: the sequence grows by one token per step, and each forward runs over all of it."
    )


@exercise(
    "01.positions-no-cache",
    question="Without a KV cache, how many token positions does the model run through in "
    "total to generate `new_tokens` tokens after a `prompt_len`-token prompt (the first "
    "token comes from the prompt's prefill)?",
    solution="The k-th forward (k = 0 .. N-1) runs over P + k tokens: "
    "`sum(range(P, P + N))` = N·P + N(N-1)/2; for the 113-token prompt and 20 tokens, "
    "20 x 113 + 190 = 2,450 positions (with the cache: 113 + 19 = 132).",
    hint=_positions_hint,
    example=lambda: {"prompt_len": 113, "new_tokens": 20},
)
def positions_no_cache(prompt_len: int, new_tokens: int) -> int:
    return sum(range(prompt_len, prompt_len + new_tokens))


def _bf16_hint(answer, right) -> str:
    if not _is_number(answer):
        return "a whole number of bytes."
    if answer * 2 == right:
        return "half of it: count both K and V (the 2 in the formula)."
    if answer == right * 2:
        return "twice it: bf16 takes 2 bytes per element, not 4."
    return "2 (K and V) x layers x kv_heads x head_dim x 2 bytes (bf16); read `spec` above."


@exercise(
    "01.kv-bytes-bf16",
    question="How many bytes of K/V does one token take in bf16 (the model's layers, KV "
    "heads and head size are printed above)?",
    solution="2 x 30 layers x 3 KV heads x 64 x 2 bytes = 23,040 bytes for SmolLM2-135M "
    "(`spec.bytes_per_token(torch.bfloat16)`).",
    hint=_bf16_hint,
    example=_smollm2,
)
def kv_bytes_bf16(spec: KVSpec) -> int:
    import torch

    return spec.bytes_per_token(torch.bfloat16)


def _users_hint(answer, right) -> str:
    if not _is_number(answer):
        return "a whole number of users."
    if answer == right // 2 or answer == (right + 1) // 2:
        return "about half: that is fp32 (4 bytes per element); the question is bf16."
    if answer == right + 1:
        return "round down: a user needs a whole region of max_model_len slots."
    return (
        "one user reserves max_model_len x bytes per token (bf16); divide the 8 GiB "
        "(8 x 2**30 bytes) by it and round down."
    )


@exercise(
    "01.naive-users",
    question="With 8 GiB for K/V, a naive cache in bf16 and max_model_len=8192, how many "
    "users can be served at once?",
    solution="One user reserves 8,192 x 23,040 bytes = 180 MiB; 8 GiB / 180 MiB = 45.5, so "
    "45 users (`8 * 2**30 // (8192 * spec.bytes_per_token(torch.bfloat16))`), whatever "
    "length their answers turn out to have.",
    hint=_users_hint,
    example=_smollm2,
)
def naive_users(spec: KVSpec) -> int:
    import torch

    return 8 * GIB // (8192 * spec.bytes_per_token(torch.bfloat16))
