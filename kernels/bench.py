"""Inputs and timers for measuring the kernels (benchmarks/gpu_check.py, notebook 06).

Random paged pools and block tables, the bytes a decode step must move, and timing on
CUDA (events, L2 flushed) or CPU (wall clock). Only torch (and triton on CUDA) needed.
"""

from __future__ import annotations

import math
import time

import torch

from .cache_write import kv_write_ref
from .kv_codes import SCALED

STORAGE = {"fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.int8}


def storage_dtype(kv_codec: str | None, dtype: torch.dtype) -> torch.dtype:
    """The pool's element type for a codec: the model's dtype, fp16/bf16, int8, or uint8
    (fp8 bits)."""
    return dtype if kv_codec is None else STORAGE.get(kv_codec, torch.uint8)


def random_pool(slots, kv_heads, dim, kv_codec, dtype, device, seed=0):
    """((k_cache, v_cache), (k_scale, v_scale)) of `slots` slots, encoded by the reference
    write from Gaussian K/V whose magnitude varies per token and head."""
    g = torch.Generator(device=device).manual_seed(seed)
    store = storage_dtype(kv_codec, dtype)
    caches = [torch.empty(slots, kv_heads, dim, dtype=store, device=device) for _ in range(2)]
    scales = [torch.empty(slots, kv_heads, dtype=torch.bfloat16, device=device) for _ in range(2)]
    step = 1 << 16
    for first in range(0, slots, step):
        n = min(step, slots - first)
        k, v = (
            torch.randn(n, kv_heads, dim, generator=g, device=device, dtype=dtype)
            * torch.exp(torch.randn(n, kv_heads, 1, generator=g, device=device, dtype=dtype))
            for _ in range(2)
        )
        where = torch.arange(first, first + n, device=device)
        kv_write_ref(k, v, *caches, where, *scales, kv_codec)
    return tuple(caches), tuple(scales)


def random_tables(lens, block_size, num_blocks, device, seed=0):
    """(block_tables (B, max_blocks) int32, context_lens (B,) int32): each sequence's
    blocks drawn at random from a pool of num_blocks."""
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil(n / block_size) for n in lens]
    if sum(need) > num_blocks:
        raise ValueError(f"{sum(need)} blocks needed, the pool has {num_blocks}")
    order = torch.randperm(num_blocks, generator=g)[: sum(need)]
    tables = torch.zeros(len(lens), max(need), dtype=torch.int32)
    first = 0
    for b, n in enumerate(need):
        tables[b, :n] = order[first : first + n]
        first += n
    return tables.to(device), torch.tensor(lens, dtype=torch.int32, device=device)


def decode_inputs(lens, shape, kv_codec, dtype, device, block_size=16, pool=None, seed=0):
    """Positional arguments of paged_decode_attention for contexts `lens` and a layer of
    `shape` = (heads, kv_heads, head_dim), over `pool` (random_pool) or a fresh one."""
    heads, kv_heads, dim = shape
    if pool is None:
        slots = sum(math.ceil(n / block_size) for n in lens) * block_size
        pool = random_pool(slots, kv_heads, dim, kv_codec, dtype, device, seed)
    (kc, vc), (ks, vs) = pool
    tables, ctx = random_tables(lens, block_size, kc.shape[0] // block_size, device, seed)
    g = torch.Generator(device=device).manual_seed(seed + 1)
    q = torch.randn(len(lens), heads, dim, generator=g, device=device, dtype=dtype)
    return (q, kc, vc, tables, ctx, dim**-0.5, block_size, ks, vs, kv_codec)


def bytes_moved(args: tuple) -> int:
    """Bytes one decode call must move at least: every context token's K and V (and their
    scales) once, the queries in, the output out, the block tables."""
    q, kc, _, tables, ctx, _, _, ks, _, kv_codec = args
    per_token = 2 * kc.shape[1] * kc.shape[2] * kc.element_size()
    if kv_codec in SCALED:
        per_token += 2 * ks.shape[1] * ks.element_size()
    return int(ctx.sum()) * per_token + 2 * q.numel() * q.element_size() + tables.numel() * 4


def bench_ms(fn, device, reps: int = 10) -> float:
    """Median time of fn() in ms: on CUDA triton.testing.do_bench (events, L2 flushed
    between runs), elsewhere wall clock over `reps` runs after one warm-up."""
    if torch.device(device).type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times)[len(times) // 2]


def copy_bandwidth(device, size_bytes: int, reps: int = 10) -> dict:
    """Measured copy bandwidth: bytes read + written by dst.copy_(src) over the time."""
    src = torch.empty(size_bytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), device, reps)
    return {"bytes": 2 * size_bytes, "ms": ms, "gb_s": 2 * size_bytes / ms / 1e6}
