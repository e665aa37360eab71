"""The systems kvlab is measured against: HF transformers on the same model and prompts.

- `hf_generate`: `model.generate` in static, left-padded batches (each batch decodes
  until its longest request is done).
- `hf_generate_batch`: transformers' continuous batching (the engine behind
  `model.generate_batch`, with its own paged KV cache).

Both decode greedily and take token-id prompts, so they see exactly what kvlab sees.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from kvlab.model.loading import LoadedModel
from kvlab.units import ceil_div

DEFAULT_BATCH_SIZE = 16
# transformers' continuous batching (ContinuousBatchingConfig, 5.x): pages of 256 tokens,
# and a FIFO scheduler that admits no new prefill while fewer than 15% of the pages are
# free (FIFOScheduler's default safety_margin).
PAGE_SIZE = 256
FIFO_SAFETY_MARGIN = 0.15


@dataclass(frozen=True)
class PeerResult:
    name: str
    outputs: list[list[int]]  # generated ids per request, cut to its own max_new_tokens
    wall_s: float
    batch_size: int | None  # static batches; None for continuous batching

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
    batch_size: int = DEFAULT_BATCH_SIZE,
    ignore_eos: bool = True,
    progress: bool = False,
) -> PeerResult:
    """HF `generate` in static, left-padded batches of `batch_size`, greedy.

    Each batch decodes until its longest request is done; outputs are then cut to each
    request's own max_new_tokens. With ignore_eos, EOS is banned (min_new_tokens) so every
    request produces exactly its token count, as kvlab does with ignore_eos.
    `progress` shows a bar of finished requests.
    """
    hf, pad = model.hf_model, model.tokenizer.pad_token_id or 0
    device = model.device
    outputs: list[list[int]] = []
    bar = tqdm(total=len(prompts), desc="hf-generate", unit="req", disable=not progress)
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
        bar.update(len(chunk))
    wall = time.perf_counter() - start
    bar.close()
    return PeerResult("hf-generate", outputs, wall, batch_size)


def choose_batch_size(
    prompt_lens: list[int],
    max_new_tokens: list[int],
    kv_budget_bytes: int | None,
    bytes_per_token: int,
    default: int = DEFAULT_BATCH_SIZE,
) -> int:
    """The batch size a user of static batches would pick: `default`, lowered to the
    largest batch whose padded KV (every row as long as the longest prompt plus the
    longest output) fits `kv_budget_bytes`, and to the number of requests."""
    size = min(default, len(prompt_lens))
    if kv_budget_bytes is not None:
        padded = (max(prompt_lens) + max(max_new_tokens)) * bytes_per_token  # one row
        size = min(size, kv_budget_bytes // padded)
    return max(1, size)


def pages_for_all(
    prompt_lens: list[int],
    max_new_tokens: list[int],
    page_size: int = PAGE_SIZE,
    safety_margin: float = FIFO_SAFETY_MARGIN,
) -> int:
    """Pages of `page_size` tokens in which transformers' continuous batching can run
    every request at once: each request's prompt + max_new_tokens in whole pages of its
    own, plus the free share its FIFO scheduler keeps before it admits another prefill
    (so the last request is not held back by the margin)."""
    needed = sum(ceil_div(p + n, page_size) for p, n in zip(prompt_lens, max_new_tokens))
    return math.ceil(round(needed / (1 - safety_margin), 9))


@torch.inference_mode()
def hf_generate_batch(
    model: LoadedModel,
    prompts: list[list[int]],
    max_new_tokens: list[int],
    num_blocks: int | None = None,
    page_size: int = PAGE_SIZE,
    max_batch_tokens: int | None = None,
    ignore_eos: bool = True,
    progress: bool = False,
) -> PeerResult:
    """transformers' continuous batching with its paged KV cache, greedy.

    `generate_batch` gives every request one max_new_tokens; to give each its own, this
    drives the same ContinuousBatchingManager the way generate_batch does (through
    `continuous_batching_context_manager`, then `add_request` per request and
    `get_result` until all are finished).

    num_blocks: cache capacity in blocks of `page_size` tokens. Set it: left as None
    on CPU, transformers sizes the cache from 90% of the machine's RAM and zero-fills it.
    `pages_for_all` gives the pages in which every request runs at once.
    max_batch_tokens: tokens per step (transformers' default when None).
    ignore_eos: eos_token_id=-1, so every request runs to its max_new_tokens.
    The wall time covers the manager's set-up, warm-up and shut-down, as a caller of
    generate_batch experiences them.
    """
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    hf, tokenizer = model.hf_model, model.tokenizer
    eos = tokenizer.eos_token_id
    generation = GenerationConfig(
        do_sample=False,
        max_new_tokens=max(max_new_tokens),
        eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos,
    )
    batching = ContinuousBatchingConfig(
        num_blocks=num_blocks, page_size=page_size, max_batch_tokens=max_batch_tokens
    )
    hints = WorkloadHints(
        max_prompt_length=max(len(p) for p in prompts),
        max_generated_length=max(max_new_tokens),
        num_requests=len(prompts),
    )
    results = {}
    bar = tqdm(total=len(prompts), desc="hf-generate-batch", unit="req", disable=not progress)
    start = time.perf_counter()
    with hf.continuous_batching_context_manager(
        generation_config=generation,
        continuous_batching_config=batching,
        block=True,
        timeout=5,
        workload_hints=hints,
    ) as manager:
        ids = [
            manager.add_request(p, max_new_tokens=n, eos_token_id=-1 if ignore_eos else eos)
            for p, n in zip(prompts, max_new_tokens)
        ]
        while len(results) < len(ids):
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching thread stopped early")
                continue
            if result.is_finished():
                if result.error is not None:
                    raise RuntimeError(f"generate_batch request failed: {result.error}")
                results[result.request_id] = result
                bar.update(1)
    wall = time.perf_counter() - start
    bar.close()
    outputs = [list(results[i].generated_tokens[:n]) for i, n in zip(ids, max_new_tokens)]
    return PeerResult("hf-generate-batch", outputs, wall, None)
