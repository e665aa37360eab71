"""Notebook 05's exercises: which running request is preempted, and what swapping one out
and back costs on a GPU server."""

from __future__ import annotations

from types import SimpleNamespace

from kvlab.cache.spec import KVSpec
from kvlab.course.exercise import exercise

# (request id, priority, admission order) of the requests running when blocks run out
RUNNING = [(0, 0, 1), (3, 1, 2), (5, 0, 3), (2, 0, 4), (6, 1, 5)]


def _victim_hint(answer, right) -> str:
    rows = {rid: (priority, order) for rid, priority, order in RUNNING}
    if answer not in rows:
        return "answer with one of the running requests' ids (the first column)."
    priority, order = rows[answer]
    if priority > min(p for p, _ in rows.values()):
        return f"request {answer} has priority {priority}: the lowest priority goes first."
    return (
        f"request {answer} has the lowest priority, but among those the one admitted most "
        "recently is preempted (the oldest keeps progressing): compare admission orders."
    )


def _running_example() -> dict:
    return {"running": RUNNING}


@exercise(
    "05.victim",
    question="Blocks ran out. The running requests are listed as (request id, priority, "
    "admission order). Which request does kvlab's scheduler preempt first?",
    solution="The victim rule is `max(running, key=(-priority, admit_order))`: lowest "
    "priority first, then the most recently admitted. Requests 0, 5 and 2 have priority 0; "
    "of those, 2 was admitted last (order 4): request 2, not 6, the latest of all, which "
    "has priority 1. vLLM V1's priority policy also preempts "
    "the least urgent request, latest arrival first among equals, but its numbers run the "
    "other way (a lower value is more urgent, so it picks the highest value); its FCFS "
    "policy pops the last of its running list.",
    hint=_victim_hint,
    example=_running_example,
    wrong=lambda right: 6,  # the most recently admitted of all, ignoring priority
)
def victim(running: list[tuple[int, int, int]]) -> int:
    from kvlab.engine.scheduler import choose_victim

    seqs = [SimpleNamespace(request_id=r, priority=p, admit_order=a) for r, p, a in running]
    return choose_victim(seqs).request_id


def _swap_hint(answer, right) -> str:
    if abs(answer * 2 - right) < 0.02 * right:
        return "that is one way: the KV goes out to host memory and comes back in."
    if any(abs(answer - right * f) < 0.02 * right * f for f in (1e-3, 1e3)):
        return "check the units: the answer is in milliseconds (bytes / (GB/s x 1e9) s)."
    return "bytes = tokens x bytes per token (spec, bf16); time = 2 x bytes / bandwidth."


def _llama3_8b() -> dict:
    return {
        "spec": KVSpec(num_layers=32, num_kv_heads=8, head_dim=128),
        "victim_tokens": 1000,
        "pcie_gb_s": 25.0,
    }


@exercise(
    "05.swap-ms",
    question="Llama-3-8B (32 layers, 8 KV heads of 128, bf16 KV) is serving on a GPU. How "
    "many milliseconds does it take to swap a `victim_tokens`-token victim out to host "
    "memory and back in at `pcie_gb_s` GB/s?",
    solution="2 x 32 x 8 x 128 x 2 = 131,072 bytes per token; 1,000 tokens = 131 MB; out "
    "and back in = 262 MB at 25 GB/s = 10.5 ms (5.2 ms at 50 GB/s). The prefill that "
    "recompute runs instead is ~2 x 8e9 x 1,000 = 1.6e13 FLOP: ~40 ms at 400 TFLOP/s. "
    "Swapping costs less device time than the prefill; the vLLM paper still found the two "
    "comparable end to end at block sizes 16-64 (small blocks make many small PCIe "
    "transfers), and recompute needs no host memory.",
    hint=_swap_hint,
    example=_llama3_8b,
    tolerance=0.02,
)
def swap_ms(spec: KVSpec, victim_tokens: int, pcie_gb_s: float) -> float:
    import torch

    moved = 2 * victim_tokens * spec.bytes_per_token(torch.bfloat16)  # out, then back in
    return moved / (pcie_gb_s * 1e9) * 1e3
