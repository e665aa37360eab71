"""Notebook 08's exercises: a token's KV bytes, the same split over tensor-parallel ranks,
and what whole blocks waste."""

from __future__ import annotations

from kvlab.course.exercise import exercise
from kvlab.planner import ModelShape, kv_bytes_per_token, plan, rank_shape


def _llama() -> dict:
    return {"shape": ModelShape.from_config("Llama-3-8B")}


def _kv_hint(answer, right) -> str:
    if answer * 2 == right:
        return "half of it: count both K and V (the 2 in the formula)."
    if answer == right * 4:
        return "that is 32 KV heads (MHA): Llama-3-8B keeps 8 KV heads for its 32 query heads."
    if answer == right * 2:
        return "twice it: bf16 takes 2 bytes per element, not 4."
    return "2 (K and V) x layers x KV heads x head_dim x 2 bytes (bf16); read the shape above."


@exercise(
    "08.kv-bytes-llama",
    question="How many bytes of KV does one Llama-3-8B token take in bf16 (32 layers, 8 KV "
    "heads of 128; the shape is printed above the question)?",
    solution="2 x 32 layers x 8 KV heads x 128 x 2 bytes = 131,072 bytes "
    "(`kv_bytes_per_token(shape, 'bf16')`); with MHA's 32 KV heads it would be 4x that.",
    hint=_kv_hint,
    example=_llama,
)
def kv_bytes_llama(shape: ModelShape) -> int:
    return kv_bytes_per_token(shape, "bf16")


def _seventy() -> dict:
    return {"shape": ModelShape.from_config("Llama-3-70B"), "tensor_parallel_size": 4}


def _tp_hint(answer, right) -> str:
    if answer == 4 * right:  # the whole model's bytes (4 ranks)
        return "that is every KV head: each rank stores only its share of them."
    if answer * 2 == right:
        return "half of it: each rank stores both K and V of its heads."
    return "2 x layers x (KV heads // ranks) x head_dim x 2 bytes: the heads are what is split."


@exercise(
    "08.tp-kv-bytes",
    question="Llama-3-70B (80 layers, 8 KV heads of 128) split over 4 devices by tensor "
    "parallelism: how many bytes of KV does each device store per token, in bf16?",
    solution="Each rank holds 8 // 4 = 2 KV heads: 2 x 80 x 2 x 128 x 2 bytes = 81,920 "
    "bytes, a quarter of the whole model's 327,680 (`plan(..., tensor_parallel_size=4)`"
    ".kv_bytes_per_token). Every rank holds every token, each its own heads.",
    hint=_tp_hint,
    example=_seventy,
)
def tp_kv_bytes(shape: ModelShape, tensor_parallel_size: int) -> int:
    return kv_bytes_per_token(rank_shape(shape, tensor_parallel_size), "bf16")


def _waste() -> dict:
    return {"context_len": 300, "block_size": 256}


def _waste_hint(answer, right) -> str:
    if answer == 256 - 300 % 256:
        return "right idea, but count the blocks: 300 tokens need more than one block of 256."
    if answer < 0:
        return "a sequence holds whole blocks: more slots than tokens, never fewer."
    return "blocks = ceil(tokens / block_size); slots held = blocks x block_size; minus tokens."


@exercise(
    "08.block-waste",
    question="A paged cache holds a sequence in whole blocks. With `block_size` = 256, how "
    "many token slots does a 300-token sequence hold that it never writes? Compute it.",
    solution="ceil(300 / 256) = 2 blocks = 512 slots for 300 tokens: 212 slots unwritten "
    "(at block 16: 19 blocks = 304 slots, 4 unwritten). Internal fragmentation: at most "
    "block_size - 1 slots per sequence.",
    hint=_waste_hint,
    example=_waste,
)
def block_waste(context_len: int, block_size: int) -> int:
    p = plan("Llama-3-8B", memory="80GiB", context_len=context_len, block_size=block_size)
    per_seq_blocks = -(-p.context_len // p.block_size)
    return per_seq_blocks * p.block_size - p.context_len
