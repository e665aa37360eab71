"""The systems kvlab is measured against: HF transformers on the same model and prompts."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kvlab.model_loading import LoadedModel


@dataclass(frozen=True)
class PeerResult:
    name: str
    outputs: list[list[int]]  # generated ids per request, cut to its own max_new_tokens
    wall_s: float
    batch_size: int

    @property
    def output_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall_s


@torch.inference_mode()
def hf_generate(
    model: LoadedModel,
    prompts: list[list[int]],
    max_new_tokens: list[int],
    batch_size: int = 16,
    ignore_eos: bool = True,
) -> PeerResult:
    """HF `generate` in static, left-padded batches of `batch_size`, greedy.

    Each batch decodes until its longest request is done; outputs are then cut to each
    request's own max_new_tokens. With ignore_eos, EOS is banned (min_new_tokens) so every
    request produces exactly its token count, as kvlab does with ignore_eos.
    """
    hf, pad = model.hf_model, model.tokenizer.pad_token_id or 0
    device = model.device
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        chunk = prompts[first : first + batch_size]
        wanted = max_new_tokens[first : first + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
        longest = max(wanted)
        out = hf.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=longest,
            min_new_tokens=longest if ignore_eos else 0,
            do_sample=False,
            pad_token_id=pad,
        )
        for row, n in zip(out[:, width:].tolist(), wanted):
            outputs.append(row[:n])
    return PeerResult("hf-generate", outputs, time.perf_counter() - start, batch_size)
