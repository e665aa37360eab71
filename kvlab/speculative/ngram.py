"""Prompt lookup (n-gram) drafting: no draft model, just the sequence's own tokens.

The last n tokens of the sequence (n from `prompt_lookup_max` down to `prompt_lookup_min`)
are looked up earlier in its prompt + output; the tokens that followed the earliest
occurrence are the draft (as HF's `prompt_lookup_num_tokens` and vLLM's "ngram" method
do). Answers that quote their input (doc-QA, summaries, code edits) get long drafts;
free chat rarely matches.
"""

from __future__ import annotations

import torch

from kvlab.sequence import Sequence
from kvlab.speculative.base import Proposer
from kvlab.speculative.registry import PROPOSERS


def lookup(tokens: torch.Tensor, n_min: int, n_max: int, k: int) -> list[int]:
    """Up to k tokens that followed the earliest earlier occurrence of the longest suffix
    of `tokens` (1-D int64) whose length is in [n_min, n_max]."""
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        windows = tokens[: length - 1].unfold(0, n, 1)  # (length - n, n): ends before the last
        hits = (windows == tokens[length - n :]).all(dim=1).nonzero()
        if len(hits):
            start = int(hits[0]) + n
            return tokens[start : start + k].tolist()
    return []


@PROPOSERS.register("ngram")
class NgramProposer(Proposer):
    def propose(self, seqs: list[Sequence], room: list[int]) -> list[list[int]]:
        c = self.config
        return [
            lookup(torch.tensor(seq.token_ids), c.prompt_lookup_min, c.prompt_lookup_max, k)
            if k
            else []
            for seq, k in zip(seqs, room)
        ]

    def describe(self) -> str:
        c = self.config
        return f"ngram (n {c.prompt_lookup_min}..{c.prompt_lookup_max})"
