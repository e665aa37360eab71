"""Self-speculation: the model's first layers, then its final norm and LM head, draft.

No second model and no second cache: the draft's layers are the target's own first
`draft_layers` layers, so the K/V they compute for verified tokens are exactly what the
target stored in those layers of the pool. Drafting reads them in place and writes the
drafts' K/V into the slots the scheduler secured for this step; the verify forward then
overwrites those slots with the full model's K/V. Cheap (a fraction of a forward per
draft token) but a shallow exit guesses worse than the full model: its acceptance is
measured, not assumed.
"""

from __future__ import annotations

import copy

import torch

from kvlab.model.metadata import build_attention_metadata
from kvlab.sequence import Sequence
from kvlab.speculative.base import Proposer
from kvlab.speculative.registry import PROPOSERS


@PROPOSERS.register("layers")
class LayerDraftProposer(Proposer):
    drafts_in_slots = True

    def __init__(self, config, runner, cache):
        super().__init__(config, runner, cache)
        total = len(runner.layers)
        self.num_layers = config.draft_layers or max(1, total // 4)
        if self.num_layers >= total:
            raise ValueError(
                f"SpeculativeConfig.draft_layers={self.num_layers} must be below the model's "
                f"{total} layers"
            )
        self.draft = copy.copy(runner)  # shares every weight tensor
        self.draft.layers = runner.layers[: self.num_layers]
        self.forwards = 0  # draft forwards run (each a batch of one token per sequence)

    def propose(self, seqs: list[Sequence], room: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in seqs]
        active = [i for i, k in enumerate(room) if k]
        tables = {i: self.cache.block_table(seqs[i]) for i in active}
        for step in range(max(room, default=0)):
            active = [i for i in active if room[i] > step]
            if not active:
                break
            # Row i feeds its last known token (the pending one, then its own drafts).
            starts = [seqs[i].num_computed + step for i in active]
            ids = [(seqs[i].token_ids + drafts[i])[-1] for i in active]
            meta = build_attention_metadata(
                starts,
                [1] * len(active),
                [tables[i] for i in active],
                self.cache.block_size,
                self.runner.device,
            )
            input_ids = torch.tensor(ids, dtype=torch.long, device=self.runner.device)
            logits = self.draft.forward(input_ids, meta, self.cache.pool)  # (B, vocab)
            self.forwards += 1
            for i, token in zip(active, logits.argmax(-1).tolist()):
                drafts[i].append(token)
        return drafts

    def describe(self) -> str:
        return f"layers (first {self.num_layers} of {len(self.runner.layers)})"
