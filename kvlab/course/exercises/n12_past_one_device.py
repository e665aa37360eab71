"""Notebook 12's exercises: which KV head each tensor-parallel rank stores, how long a
prefilled prompt's KV takes to cross a network, and which decode engine of a pool takes
the next prefilled request."""

from __future__ import annotations

from types import SimpleNamespace

from kvlab.course.exercise import exercise

TP = 9  # the tensor-parallel size of 12.kv-head-per-rank
LINK_GBPS = 25  # GB/s of 12.transfer-ms (a 200 Gb/s NIC)


def _smollm2() -> dict:
    """SmolLM2-135M's heads (9 query, 3 KV), for the tests."""
    return {"cfg": SimpleNamespace(num_attention_heads=9, num_key_value_heads=3)}


def _head_hint(answer, right) -> str:
    if not isinstance(answer, (list, tuple)):
        return f"a list: one KV head number per rank, {len(right)} ranks at tp={TP}."
    if len(answer) != len(right):
        return f"one entry per rank: {len(right)} ranks at tp={TP}."
    if list(answer) == [r % len(set(right)) for r in range(len(right))]:
        return ("the ranks are not dealt heads in turn: kv_head_range gives each head to a "
                "run of consecutive ranks (first = rank * kv_heads // tp).")  # fmt: skip
    return "read kv_head_range above: past tp = kv_heads, first = rank * kv_heads // tp."


@exercise(
    "12.kv-head-per-rank",
    question=f"At tp = {TP} the 3 KV heads are replicated. Which KV head does each rank "
    f"0-{TP - 1} store? (a list of {TP} head numbers, rank 0 first)",
    solution="[0, 0, 0, 1, 1, 1, 2, 2, 2]: rank r stores head r * 3 // 9, so each KV head "
    "is held by 3 consecutive ranks, the ranks whose query heads read it "
    "(`kv_head_range`).",
    hint=_head_hint,
    example=_smollm2,
    wrong=lambda right: [r % 3 for r in range(len(right))],
)
def kv_head_per_rank(cfg) -> list[int]:
    from kvlab.parallel.shard import kv_head_range

    kv = cfg.num_key_value_heads
    return [kv_head_range(rank, TP, kv).start for rank in range(TP)]


def _ms_hint(answer, right) -> str:
    if not isinstance(answer, (int, float)) or answer <= 0:
        return "a positive number of milliseconds."
    if abs(answer / right - 1000) < 50:
        return "that is microseconds: divide by 1,000 for milliseconds."
    if abs(answer * 1000 / right - 1) < 0.05:
        return "that is seconds: multiply by 1,000 for milliseconds."
    if abs(answer / right - 8) < 0.5:
        return "GB/s are bytes, not bits: no factor 8."
    return f"bytes / ({LINK_GBPS} x 10^9 bytes/s) gives seconds; x 1,000 for milliseconds."


@exercise(
    "12.transfer-ms",
    question=f"The disaggregated run moved `bytes_moved` bytes of KV (printed above). How "
    f"many milliseconds would they take over a {LINK_GBPS} GB/s link (a 200 Gb/s NIC)?",
    solution="bytes_moved / 25e9 * 1e3: 21,381,120 bytes (464 prompt tokens x 46,080 bytes) "
    "take about 0.86 ms, against seconds of prefill on this CPU (on a GPU this model's "
    "prefill of those tokens takes milliseconds too, which is when the link matters).",
    hint=_ms_hint,
    example=lambda: {"bytes_moved": 21_381_120},
    tolerance=0.02,
)
def transfer_ms(bytes_moved: int) -> float:
    return bytes_moved / (LINK_GBPS * 1e9) * 1e3


SNAPSHOT = [(3, 40), (2, 12), (2, 30)]  # 12.route-next: (requests, free blocks) per engine


def _route_hint(answer, right) -> str:
    if not isinstance(answer, int) or isinstance(answer, bool) or not 0 <= answer < 3:
        return "an engine's index: 0, 1 or 2 (engines are numbered from 0)."
    if answer == 0:
        return "fewest unfinished requests comes first; free blocks only break a tie."
    return "engines 1 and 2 tie on requests: the one with more free KV blocks takes it."


@exercise(
    "12.route-next",
    question="A 1P:3D pool's decode engines hold (unfinished requests, free KV blocks) = "
    f"{SNAPSHOT}. Which engine (0, 1 or 2) does the least-loaded policy give the next "
    "prefilled request?",
    solution="2: engines 1 and 2 tie on the fewest requests (2); engine 2 has more free "
    "blocks (30 > 12). Engine 0 has the most free blocks but more requests, which count "
    "first (`least_loaded`).",
    hint=_route_hint,
    example=lambda: {"snapshot": SNAPSHOT},
    wrong=lambda right: 1,
)
def route_next(snapshot: list[tuple[int, int]]) -> int:
    from kvlab.disagg.routing import Load, least_loaded

    return least_loaded([Load(requests, free) for requests, free in snapshot])
