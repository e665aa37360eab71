"""Notebook 06's exercises: decode attention's arithmetic intensity with int8 K/V, the
slots a block table sends the kernel to, and the least time a decode call can take."""

from __future__ import annotations

from kvlab.course.exercise import exercise


def _smollm2_layer() -> dict:
    return {"heads": 9, "kv_heads": 3, "head_dim": 64}


def _intensity_hint(answer, right) -> str:
    if abs(answer - 3.0) < 0.05:
        return "that is bf16 (2 bytes per element): int8 codes take 1 byte each."
    if abs(answer - 6.0) < 0.05:
        return (
            "close: you left out the scales. Each token keeps a 2-byte bf16 scale per KV "
            "head, for K and for V, and the kernel must read them too."
        )
    return "FLOP per context token (as above) / bytes per context token (codes + scales)."


@exercise(
    "06.int8-intensity",
    question="With int8 K/V (1 byte per element, plus one bf16 scale per token per KV head, "
    "for K and for V), what is decode attention's arithmetic intensity in FLOP per byte?",
    solution="FLOP per context token: 4 x 9 heads x 64 = 2,304 (unchanged). Bytes: "
    "2 x 3 KV heads x (64 codes + 2 scale bytes) = 396. 2,304 / 396 = 5.8 FLOP/byte: "
    "still far below the ~200 a GPU can do per byte read, so int8 decode attention is "
    "memory-bound too, and about 1.9x faster than bf16 if the kernel reads each byte once.",
    hint=_intensity_hint,
    example=_smollm2_layer,
    tolerance=0.01,
)
def int8_intensity(heads: int, kv_heads: int, head_dim: int) -> float:
    flops = 4 * heads * head_dim
    read = 2 * kv_heads * (head_dim * 1 + 2)  # K and V: int8 codes + a bf16 scale per head
    return flops / read


def _walk_example() -> dict:
    return {"tables": [[5, 2, 7], [1, 6]], "lens": [10, 6], "block_size": 4}


def _slots_hint(answer, right) -> str:
    answer = list(answer) if isinstance(answer, (list, tuple)) else answer
    if answer == list(range(len(right))):
        return "those are positions: each must go through the block table to a slot."
    if isinstance(answer, list) and len(answer) != len(right):
        return f"one slot per position of sequence 1's context: {len(right)} of them."
    return "slot = table[p // block_size] x block_size + p % block_size, for p = 0, 1, ..."


@exercise(
    "06.slots",
    question="Sequence 1 has block table [1, 6] and 6 tokens; blocks hold `block_size` = 4 "
    "slots. List the pool slot the kernel reads for each of its positions 0, 1, ..., 5.",
    solution="Positions 0-3 are in logical block 0 = physical block 1: slots 4, 5, 6, 7; "
    "positions 4-5 are in logical block 1 = physical block 6: slots 24, 25. So "
    "[4, 5, 6, 7, 24, 25]; the rest of block 6 (slots 26, 27) is masked, never read.",
    hint=_slots_hint,
    example=_walk_example,
    wrong=lambda right: list(range(len(right))),
)
def slots(tables: list[list[int]], lens: list[int], block_size: int) -> list[int]:
    from kvlab.kernels import walk

    rows = walk(tables, lens, block_size=block_size, tile=block_size, num_splits=1)
    return [row["slot"] for row in rows if row["seq"] == 1]


def _least_time_hint(answer, right) -> str:
    if any(abs(answer - right * f) < 0.03 * right * f for f in (1e-3, 1e3)):
        return "check the units: the answer is in milliseconds."
    if abs(answer - right / 2) < 0.03 * right:
        return "the copy bandwidth counts bytes read and written; use it as printed."
    return "time = bytes / (GB/s x 1e9) seconds, then x 1e3 for ms."


@exercise(
    "06.least-time",
    question="The decode call printed above must read `bytes_read` bytes. At this machine's "
    "copy bandwidth (`copy_gb_s`, printed), what is the least time it can take, in ms?",
    solution="bytes / (copy_gb_s x 1e9) x 1e3 ms: the point on the roofline at that many "
    "bytes. The measured call takes longer; its ratio to this time is the fraction of the "
    "copy bandwidth in the table that follows.",
    hint=_least_time_hint,
    example=lambda: {"bytes_read": 3_200_000, "copy_gb_s": 8.0},
    tolerance=0.03,
)
def least_time(bytes_read: int, copy_gb_s: float) -> float:
    return bytes_read / (copy_gb_s * 1e9) * 1e3
