"""Notebook 15's exercises: a sum's order in fp32, which logit change can flip a greedy
token, and what batch-invariant mode leaves of the drift."""

from __future__ import annotations

from kvlab.course.exercise import exercise

FLIPS = ("neither", "fp32 only", "int8 only", "both")  # 15.which-flips' options


def _order_hint(answer, right) -> str:
    if hasattr(answer, "item"):
        return "a tensor: write float(...) around your expression, ask() compares numbers."
    if answer == 0:
        return ("0 in exact arithmetic; compute both sums with float32 tensors: -1e8 + 1 "
                "has no float32 of its own and rounds back to -1e8.")  # fmt: skip
    return "compute ((a + b) + c) - (a + (b + c)) with the float32 tensors a, b, c."


@exercise(
    "15.sum-order",
    question="With float32 a = 1e8, b = -1e8, c = 1: what is ((a + b) + c) - (a + (b + c))? "
    "Compute it with torch.",
    solution="1.0: (a + b) + c = 0 + 1 = 1, but b + c = -99,999,999 is not a float32 (the "
    "spacing there is 8) and rounds to -1e8, so a + (b + c) = 0. The same terms in another "
    "order give another sum: what a kernel's blocking does to a dot product.",
    hint=_order_hint,
    example=lambda: {},
)
def sum_order() -> float:
    import torch

    a, b, c = (torch.tensor(v, dtype=torch.float32) for v in (1e8, -1e8, 1.0))
    return float(((a + b) + c) - (a + (b + c)))


def _flip_hint(answer, right) -> str:
    return ("a token can flip only where the change in its logits reaches the margin: "
            "compare each table's max_logit_change with the gap.")  # fmt: skip


@exercise(
    "15.which-flips",
    question="This run's largest logit changes are the `max_logit_change` columns of the "
    "fp32 and int8 tables. Which of them could flip a greedy token whose margin over the "
    "runner-up is `gap`?",
    solution="Compare each change with the gap: a change smaller than the margin cannot "
    "reorder the top two. With changes like the stored run's (fp32 about 4e-05, int8 about "
    "0.15) and a gap of 0.05: 'int8 only'. fp32 drift is orders of magnitude below usual "
    "margins; int8 amplifies it to a code step.",
    hint=_flip_hint,
    example=lambda: {"fp32_change": 3.8e-05, "int8_change": 0.22, "gap": 0.05},
    choices=FLIPS,
)
def which_flips(fp32_change: float, int8_change: float, gap: float) -> str:
    return FLIPS[(fp32_change >= gap) + 2 * (int8_change >= gap)]


def _bits_hint(answer, right) -> str:
    return ("batch-invariant mode sums every reduction of a row in an order fixed by the "
            "row alone: what can company, chunks or threads change then?")  # fmt: skip


@exercise(
    "15.invariant-bits",
    question="In batch-invariant mode, int8 KV, the same four settings: how many steps, "
    "over all settings, have logits with other bits than the run alone?",
    solution="0: every reduction in the forward (linears, RMSNorm, attention) runs in an "
    "order fixed by the row, and the rest are single IEEE operations, so neither the batch, "
    "the chunking, a prefix hit nor the thread count changes a bit.",
    hint=_bits_hint,
    example=lambda: {"other_bits": [0, 0, 0, 0]},
)
def invariant_bits(other_bits) -> int:
    return int(sum(other_bits))
