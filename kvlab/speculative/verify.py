"""Verification: which drafted tokens the model accepts, and the one token it adds.

For a sequence with d drafts, the step's forward gives d + 1 rows of logits: row i
predicts the token after draft i - 1 (row 0: after the pending token).

- Greedy: accept drafts while each equals the argmax of its row; then emit the argmax of
  the first disagreeing row (or of row d when all are accepted). The output is exactly
  what d + 1 greedy decode steps would give.
- Sampling (temperature > 0): speculative rejection sampling (Leviathan et al., Chen et
  al., 2023). kvlab's proposers draft deterministically (q puts all its mass on the
  draft x), so draft x is accepted with probability p(x), and on rejection the token is
  drawn from the residual max(p - q, 0) normalised: p with x removed. Every emitted
  token is distributed exactly as sampling from p would be.
"""

from __future__ import annotations

import torch

from kvlab.config import SamplingParams
from kvlab.engine.sampler import draw, probabilities


def accept_greedy(logits: torch.Tensor, drafts: list[int]) -> list[int]:
    """logits: (d + 1, vocab) -> the accepted drafts, then the model's own next token."""
    target = logits.argmax(dim=-1).tolist()
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == target[accepted]:
        accepted += 1
    return drafts[:accepted] + [target[accepted]]


def accept_sampled(
    logits: torch.Tensor,
    drafts: list[int],
    params: SamplingParams,
    generator: torch.Generator | None,
) -> list[int]:
    """logits: (d + 1, vocab) -> accepted drafts, then a token from the residual (after a
    rejection) or from the last row's distribution (all accepted)."""
    emitted = []
    for row, draft in enumerate(drafts):
        p = probabilities(logits[row], params)  # (vocab,)
        if float(torch.rand((), generator=generator)) < float(p[draft]):
            emitted.append(draft)
            continue
        residual = p.clone()
        residual[draft] = 0.0  # max(p - q, 0) for q = one-hot(draft)
        return emitted + [draw(residual / residual.sum(), generator)]
    return emitted + [draw(probabilities(logits[len(drafts)], params), generator)]


def accept(
    logits: torch.Tensor,
    drafts: list[int],
    params: SamplingParams,
    generator: torch.Generator | None,
) -> list[int]:
    """The tokens one verified row emits (1 to len(drafts) + 1 of them)."""
    if params.greedy:
        return accept_greedy(logits, drafts)
    return accept_sampled(logits, drafts, params, generator)
