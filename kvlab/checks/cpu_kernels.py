"""The native CPU attention kernels against torch, on one model's attention shapes.

    prompt_rows(cases)          each prompt kernel call against the torch reference's
    decode_after_matmul()       a decode kernel call alone and right after a matmul
    cascade_rows(prefixes)      bf16 decodes sharing a prefix: the decode kernel against
                                cascade attention (kvlab.kernels.cpu_cascade)

Each builds a paged pool with its blocks in random order and time calls alternately, best
of `rounds`, so the two sides share the machine's state. benchmarks/cpu_kernels.py prints
them.
"""

from __future__ import annotations

import itertools
import time
from functools import partial

import torch

from kvlab.cache.pool import KVPool
from kvlab.cache.spec import KVSpec
from kvlab.model.attention import pooled_attention
from kvlab.model.kernel_args import pool_layer
from kvlab.model.metadata import build_attention_metadata

BLOCK = 16
SMOLLM2 = {"heads": 9, "kv_heads": 3, "head_dim": 64}  # SmolLM2-135M's attention


def best_ms(fn, rounds: int) -> float:
    """The fastest of `rounds` calls of fn, in milliseconds, after one warm-up call."""
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def mean_ms(fn, calls: int) -> float:
    """The mean of `calls` back-to-back calls of fn, in milliseconds, after a warm-up."""
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return 1e3 * (time.perf_counter() - start) / calls


def _pool(tokens: int, kv_heads: int, head_dim: int, seed: int, dtype=torch.float32) -> KVPool:
    """A one-layer pool of `tokens` slots filled with Gaussian K/V."""
    g = torch.Generator().manual_seed(seed)
    pool = KVPool(KVSpec(1, kv_heads, head_dim), tokens, dtype, torch.device("cpu"))
    every = torch.arange(pool.num_slots)
    k, v = (torch.randn(pool.num_slots, kv_heads, head_dim, generator=g) for _ in range(2))
    pool.write(0, every, k.to(dtype), v.to(dtype))
    return pool


def prompt_rows(
    cases: list[tuple[int, int]],
    heads=9,
    kv_heads=3,
    head_dim=64,
    rounds=5,
    dtype=torch.float32,
) -> list[dict]:
    """For each (cached P, new Q): ms and GFLOP/s of one layer's prompt attention through
    the C prompt kernel ("amx" for bf16 where the CPU has it, else the fp32 register
    "tiles") and through the torch reference (pooled_attention: scaled_dot_product_attention,
    causal, or masked after a prefix), and the largest difference between them; for bf16
    also the register tiles' ms (`tiles_ms`: what a bf16 prompt would cost without AMX)."""
    from kvlab.kernels import cpu_paged_prefill_attention
    from kvlab.kernels.cpu_prefill import on_amx

    rows = []
    for seed, (cached, new) in enumerate(cases):
        total = cached + new
        blocks = -(-total // BLOCK)
        pool = _pool((blocks + 4) * BLOCK, kv_heads, head_dim, seed, dtype)
        table = torch.randperm(blocks + 4)[:blocks].tolist()
        meta = build_attention_metadata([cached], [new], [table], BLOCK, "cpu")
        q = torch.randn(new, heads, head_dim, generator=torch.Generator().manual_seed(seed))
        q = q.to(dtype)
        scale = head_dim**-0.5
        layer, slots = pool_layer(pool, 0), meta.groups[0].slots[0]
        amx = on_amx(q, layer["k_cache"])
        caches = (layer["k_cache"], layer["v_cache"], slots, scale)
        kernel = partial(cpu_paged_prefill_attention, q, *caches, amx=amx)
        calls = {"kernel": kernel, "torch": partial(pooled_attention, q, 0, pool, meta, scale)}
        if dtype == torch.bfloat16:
            calls["tiles"] = partial(cpu_paged_prefill_attention, q, *caches, amx=False)
        diff = (kernel().float() - calls["torch"]().float()).abs().max().item()
        times = {name: [] for name in calls}
        for _ in range(rounds):  # alternated, so all see the same machine
            for name, call in calls.items():
                times[name].append(best_ms(call, 1))
        flops = 4 * heads * head_dim * (new * cached + new * (new + 1) / 2)
        kernel_ms, torch_ms = min(times["kernel"]), min(times["torch"])
        rows.append(
            {
                "cached": cached,
                "new": new,
                "dtype": str(dtype).removeprefix("torch."),
                "kernel": "amx" if amx else "tiles",
                "kernel_ms": round(kernel_ms, 3),
                "torch_ms": round(torch_ms, 3),
                "kernel_gflop_s": round(flops / kernel_ms / 1e6, 1),
                "torch_gflop_s": round(flops / torch_ms / 1e6, 1),
                "speedup": round(torch_ms / kernel_ms, 2),
                "max_abs_diff": diff,
            }
            | ({"tiles_ms": round(min(times["tiles"]), 3)} if "tiles" in times else {})
        )
    return rows


def decode_after_matmul(
    batch=32,
    context=1115,
    heads=9,
    kv_heads=3,
    head_dim=64,
    hidden=576,
    rounds=30,
    dtype="float32",
) -> dict:
    """One decode kernel call over `batch` sequences of `context` tokens: ms alone, and ms
    right after a (batch, hidden) x (hidden, 3 hidden) matmul (the matmul's own time
    taken off), as the runner calls it; means of `rounds` calls, the best of 3 repeats;
    and whose threads ran it. `dtype`: the name of q's, K/V's and the matmul's dtype."""
    from kvlab.kernels import cpu_paged_decode_attention
    from kvlab.kernels.cpu_build import cpu_kernels_threads

    g, dt = torch.Generator().manual_seed(0), getattr(torch, dtype)
    blocks = -(-context // BLOCK)
    num_slots = (batch * blocks + 8) * BLOCK
    k, v = (torch.randn(num_slots, kv_heads, head_dim, generator=g).to(dt) for _ in range(2))
    tables = torch.randperm(num_slots // BLOCK, generator=g)[: batch * blocks].view(batch, -1)
    pos = torch.arange(context)
    slots = tables[:, pos // BLOCK] * BLOCK + pos % BLOCK  # (B, S)
    lens = torch.full((batch,), context)
    q = torch.randn(batch, heads, head_dim, generator=g).to(dt)
    x = torch.randn(batch, hidden, generator=g).to(dt)
    w = torch.randn(hidden, 3 * hidden, generator=g).to(dt)
    decode = partial(cpu_paged_decode_attention, q, k, v, slots, lens, head_dim**-0.5)
    matmul = partial(torch.matmul, x, w)

    def both():
        matmul()
        decode()

    alone, after = [], []
    for _ in range(3):
        alone.append(mean_ms(decode, rounds))
        after.append(mean_ms(both, rounds) - mean_ms(matmul, rounds))
    return {
        "dtype": dtype,
        "threads": cpu_kernels_threads(),
        "torch_threads": torch.get_num_threads(),
        "decode_alone_ms": round(min(alone), 3),
        "decode_after_matmul_ms": round(min(after), 3),
    }


def shared_prefix_case(
    batch: int, shared: int, own: int, heads=9, kv_heads=3, head_dim=64, seed=0
) -> tuple[torch.Tensor, ...]:
    """q, k_cache, v_cache (bf16), slots, lens of `batch` decodes whose first `shared`
    positions lie in the same blocks (in random order in the pool), then 1 to `own`
    positions each of their own; every slot no sequence reads holds NaN."""
    g = torch.Generator().manual_seed(seed)
    lens = shared + torch.randint(1, own + 1, (batch,), generator=g)
    per_seq = -(-int(lens.max()) // BLOCK)
    common = -(-shared // BLOCK)  # the prefix's blocks (its last one may be partial)
    total = common + batch * (per_seq - common) + 3  # a few spare blocks
    order = torch.randperm(total, generator=g)
    own_blocks = order[common : common + batch * (per_seq - common)].view(batch, -1)
    tables = torch.cat([order[:common].expand(batch, -1), own_blocks], dim=1)  # (B, per_seq)
    pos = torch.arange(per_seq * BLOCK)
    slots = tables[:, pos // BLOCK] * BLOCK + pos % BLOCK  # (B, S)
    k, v = (torch.randn(total * BLOCK, kv_heads, head_dim, generator=g) for _ in "kv")
    unused = torch.ones(total * BLOCK, dtype=torch.bool)
    unused[slots[pos[None, :] < lens[:, None]]] = False
    k[unused], v[unused] = float("nan"), float("nan")
    q = torch.randn(batch, heads, head_dim, generator=g)
    return q.bfloat16(), k.bfloat16(), v.bfloat16(), slots, lens


def cascade_rows(
    prefixes: list[int],
    batches: tuple[int, ...] = (32,),
    own: int = 300,
    rounds: int = 5,
    heads=9,
    kv_heads=3,
    head_dim=64,
    seed=0,
) -> list[dict]:
    """For each batch size B and shared prefix length P: one layer's bf16 decode attention
    of B sequences whose first P positions are the same blocks and whose own parts are 1 to
    `own` positions more (shared_prefix_case), through the decode kernel (a chunk shared
    by up to 16 sequences read once for them) and through cascade attention (the prefix
    once for all), alternated, best of `rounds`; the largest difference between the two,
    and whether cascade_pays takes it. Needs a CPU with AMX-BF16."""
    from kvlab.kernels import cpu_paged_decode_attention
    from kvlab.kernels.cpu_cascade import cascade_pays, cpu_cascade_decode_attention

    rows = []
    for batch, shared in itertools.product(batches, prefixes):
        q, k, v, slots, lens = shared_prefix_case(
            batch, shared, own, heads, kv_heads, head_dim, seed + shared
        )
        plain = partial(cpu_paged_decode_attention, q, k, v, slots, lens, head_dim**-0.5)
        cascade = partial(cpu_cascade_decode_attention, q, k, v, slots, lens,
                          head_dim**-0.5, shared)  # fmt: skip
        times = {"decode kernel": [], "cascade": []}
        for _ in range(rounds):  # alternated, so both see the machine's state
            times["decode kernel"].append(best_ms(plain, 1))
            times["cascade"].append(best_ms(cascade, 1))
        diff = (plain().float() - cascade().float()).abs().max().item()
        rows.append({
            "sequences": batch, "shared": shared, "mean_context": float(lens.float().mean()),
            "decode_kernel_ms": min(times["decode kernel"]), "cascade_ms": min(times["cascade"]),
            "max_abs_diff": diff, "taken": cascade_pays(q, k, shared),
        })  # fmt: skip
    return rows
