"""Decoding with and without a KV cache, timed token by token on the real model.

Without a cache every new token re-runs the model over the whole sequence so far
(O(n) work per token, O(n^2) in total). With a cache each token runs the model over just
itself and reads the earlier tokens' K/V from memory. Both produce the same greedy tokens.
"""

from __future__ import annotations

import time

import pandas as pd
import torch

from kvlab.cache.pool import KVPool
from kvlab.model.metadata import build_attention_metadata
from kvlab.model.runner import ModelRunner


def decode_timings(
    runner: ModelRunner, prompt_ids: list[int], new_tokens: int, use_cache: bool
) -> pd.DataFrame:
    """Greedy-decode `new_tokens` tokens, timing each one.

    Returns one row per generated token: `position` (its index in the sequence),
    `latency_s` (time to produce it), `token` (its id). The prompt's prefill produces the
    first token in both modes.
    """
    capacity = len(prompt_ids) + new_tokens
    pool = KVPool(runner.kv_spec, capacity, runner.dtype, runner.device)
    tokens, rows = list(prompt_ids), []
    for _ in range(new_tokens):
        # No cache: recompute every position from 0. Cache: compute only the new token.
        start = len(tokens) - 1 if use_cache and rows else 0
        begin = time.perf_counter()
        meta = build_attention_metadata(
            [start], [len(tokens) - start], [[0]], capacity, runner.device
        )
        ids = torch.tensor(tokens[start:], dtype=torch.long, device=runner.device)
        token = int(runner.forward(ids, meta, pool)[0].argmax())
        rows.append((len(tokens), time.perf_counter() - begin, token))
        tokens.append(token)
    return pd.DataFrame(rows, columns=["position", "latency_s", "token"])


def compare_decoding(runner: ModelRunner, prompt_ids: list[int], new_tokens: int) -> pd.DataFrame:
    """Both modes side by side: columns position, latency_s, token, mode."""
    frames = []
    for use_cache in (False, True):
        frame = decode_timings(runner, prompt_ids, new_tokens, use_cache)
        frames.append(frame.assign(mode="KV cache" if use_cache else "no cache"))
    return pd.concat(frames, ignore_index=True)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters (tied tensors counted once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total
