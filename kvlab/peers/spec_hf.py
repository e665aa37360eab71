"""HF transformers' prompt lookup beside kvlab's n-gram drafting, on the same prompts.

`generate(prompt_lookup_num_tokens=k)` drafts up to k tokens that followed an earlier
occurrence of the sequence's last n tokens (n from `max_matching_ngram_size` down to 1)
and verifies them in one forward: HF's counterpart of kvlab's "ngram" proposer. It
decodes one sequence at a time (batch 1).

Every run prefills its prompt: in transformers 5.24, prompt lookup handed a prefilled
cache (`past_key_values`) recomputes the prompt on top of it and its tokens go wrong, so
the prompt-reuse recipe is not used for either side. A forward pre-hook counts the
target forwards, the tokens each one computes and when each starts: decode time runs
from the start of the second forward (the first is the prompt's) to the end, and tokens
per forward and acceptance follow from the same arithmetic as kvlab's.
"""

from __future__ import annotations

import time

import torch

from kvlab.model.loading import LoadedModel


class ForwardCounter:
    """Counts an HF model's forwards and the new tokens each computes."""

    def __init__(self, hf_model):
        self.lengths: list[int] = []  # input tokens per forward
        self.starts: list[float] = []  # perf_counter() at each forward's start
        self._hook = hf_model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.lengths.append(int(ids.shape[-1]))
        self.starts.append(time.perf_counter())

    def close(self) -> None:
        self._hook.remove()


@torch.inference_mode()
def hf_decode(
    model: LoadedModel,
    prompt: list[int],
    max_new_tokens: int,
    k: int = 0,
    ngram_max: int = 2,
) -> tuple[list[int], float, float, list[int]]:
    """One greedy `generate` (prompt lookup when k > 0) -> (output ids, wall seconds,
    decode seconds, input tokens of every target forward, the prompt's first)."""
    hf, tokenizer = model.hf_model, model.tokenizer
    ids = torch.tensor([prompt], device=model.device)
    options = dict(prompt_lookup_num_tokens=k, max_matching_ngram_size=ngram_max) if k else {}
    counter = ForwardCounter(hf)
    try:
        start = time.perf_counter()
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
            **options,
        )
        end = time.perf_counter()
    finally:
        counter.close()
    decode_s = end - counter.starts[1] if len(counter.starts) > 1 else 0.0
    return out[0, len(prompt) :].tolist(), end - start, decode_s, counter.lengths


def run_hf(
    model: LoadedModel,
    prompts: list[list[int]],
    max_new_tokens: list[int],
    ks: tuple[int, ...],
    ngram_max: int = 2,
    warmup: bool = True,
) -> dict[int, dict]:
    """Plain `generate` (k = 0) and prompt lookup at each k on every prompt, batch 1 ->
    {k: {"outputs", "wall_s", "decode_s", "lengths" (input tokens of each decode
    forward, all prompts)}}; the order of the k alternates from prompt to prompt."""
    order = [0, *ks]
    acc = {k: {"outputs": [], "wall_s": 0.0, "decode_s": 0.0, "lengths": []} for k in order}
    if warmup:  # first-call costs, untimed
        for k in order:
            hf_decode(model, prompts[0][-8:], 4, k, ngram_max)
    for i, (prompt, n) in enumerate(zip(prompts, max_new_tokens)):
        for k in order if i % 2 == 0 else order[::-1]:
            tokens, wall_s, decode_s, lengths = hf_decode(model, prompt, n, k, ngram_max)
            acc[k]["outputs"].append(tokens)
            acc[k]["wall_s"] += wall_s
            acc[k]["decode_s"] += decode_s
            acc[k]["lengths"] += lengths[1:]
    return acc
