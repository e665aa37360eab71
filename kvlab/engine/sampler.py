"""Turn each sequence's next-token logits into a token: greedy, or seeded sampling."""

from __future__ import annotations

import torch

from kvlab.config import SamplingParams
from kvlab.sequence import Sequence


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """logits: (B, vocab) float32 or the model's dtype, one row per sequence -> one token id
    per sequence. Greedy rows take the first maximal logit, as argmax does: max(dim)
    returns the same index (torch documents both as the first maximal value) and runs 3-5x
    faster than argmax on the CPU (16 rows of SmolLM2's 49,152 logits in bf16: 0.34 against
    1.8 ms on the 2-core Xeon)."""
    tokens = logits.max(dim=-1).indices.tolist()  # greedy for every row, then sampled rows
    for row, seq in enumerate(seqs):
        if not seq.params.greedy:
            tokens[row] = sample_one(logits[row], seq.params, seq.generator)
    return tokens


def sample_one(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> int:
    """Temperature, then top-k, then top-p (nucleus) filtering, then one multinomial draw."""
    return draw(probabilities(logits, params), generator)


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution one token is drawn from: (vocab,) logits -> (vocab,) float32 probs
    after temperature, top-k and top-p (nucleus) filtering."""
    logits = logits.float() / params.temperature  # (vocab,)
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token once the tokens before it already cover top_p of the mass.
        drop = cumulative - sorted_logits.softmax(-1) >= params.top_p
        logits = logits.scatter(0, order[drop], float("-inf"))
    return logits.softmax(-1)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token id from (vocab,) probabilities."""
    return int(torch.multinomial(probs.cpu(), 1, generator=generator).item())
