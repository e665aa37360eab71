"""Decoding with and without a KV cache, timed on the real model.

Without a cache every new token re-runs the model over the whole sequence so far: at
context n the linear layers (QKV, output projection, MLP) do O(n) work and attention,
every token against every earlier one, O(n^2). With a cache each token runs the model over
just itself: the linears do O(1) work and its attention reads the n earlier tokens' K/V,
O(n). Both produce the same greedy tokens.

`compare_decoding` times a short greedy continuation token by token; `latency_by_context`
times one generated token at each of several context lengths (64 to ~1,000 tokens), where
the growth of the no-cache time is large enough to see above the noise.
"""

from __future__ import annotations

import statistics
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


def latency_by_context(
    runner: ModelRunner, text_ids: list[int], lengths: list[int], repeats: int = 3
) -> pd.DataFrame:
    """Time to produce the token that follows the first n tokens of `text_ids`, for each n
    in `lengths`, both ways: without a cache (one forward over all n tokens) and with one
    (a forward over token n alone, reading tokens 1..n-1's K/V from a pool that a prefill of
    the longest context filled beforehand, untimed).

    Returns one row per length and mode: `context` (n), `mode`, `latency_s` (the median of
    `repeats` timings, so one preempted run on a busy machine does not set the point) and
    `token` (the greedy next token, the same both ways).
    """
    longest = max(lengths)
    if longest > len(text_ids):
        raise ValueError(f"lengths go up to {longest} tokens; text_ids has {len(text_ids)}")
    filled = KVPool(runner.kv_spec, longest, runner.dtype, runner.device)  # the cache
    scratch = KVPool(runner.kv_spec, longest, runner.dtype, runner.device)  # no cache

    def forward(pool: KVPool, start: int, end: int) -> int:
        meta = build_attention_metadata([start], [end - start], [[0]], longest, runner.device)
        ids = torch.tensor(text_ids[start:end], dtype=torch.long, device=runner.device)
        return int(runner.forward(ids, meta, pool)[0].argmax())

    forward(filled, 0, longest)  # the cache holds every context's K/V (not timed)
    rows = []
    for n in lengths:
        for mode, pool, start in (("no cache", scratch, 0), ("KV cache", filled, n - 1)):
            times = []
            for _ in range(repeats):
                begin = time.perf_counter()
                token = forward(pool, start, n)
                times.append(time.perf_counter() - begin)
            rows.append((n, mode, statistics.median(times), token))
    return pd.DataFrame(rows, columns=["context", "mode", "latency_s", "token"])


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters (tied tensors counted once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total
