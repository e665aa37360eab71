"""kvlab.kernels.cpu_paged_prefill_attention (the native prompt kernel) against plain torch.

The reference gathers the sequence's slots and runs a causal softmax(q k^T * scale) v per
head in fp32, row i of Q seeing the first S - Q + i + 1 positions. The cache is laid out
like a paged cache with its blocks in random order, and every slot the sequence does not
own holds NaN, so a read past its slots would show. The shapes cross the kernel's tiles:
16 query positions per task, 256 key positions per chunk, 32 per score tile, 6 rows per
register tile.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kvlab.kernels import (
    cpu_kernels_available,
    cpu_paged_decode_attention,
    cpu_paged_prefill_attention,
)
from kvlab.kernels.cpu_build import cpu_kernels_error, cpu_kernels_have, cpu_kernels_threads

BLOCK = 16
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.fixture(autouse=True)
def _needs_kernel():
    if not cpu_kernels_available():
        pytest.skip(f"the native CPU kernels are unavailable: {cpu_kernels_error()}")


def reference(q, k_cache, v_cache, slots, scale):
    """Gather the slots; causal fp32 softmax attention per head (GQA)."""
    rows, S = q.shape[0], slots.shape[0]
    group = q.shape[1] // k_cache.shape[1]
    k = k_cache[slots].float().repeat_interleave(group, dim=1)  # (S, heads, D)
    v = v_cache[slots].float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,shd->hqs", q.float(), k) * scale  # (heads, Q, S)
    seen = torch.arange(S)[None, :] <= torch.arange(S - rows, S)[:, None]  # (Q, S)
    p = scores.masked_fill(~seen, float("-inf")).softmax(-1)
    return torch.einsum("hqs,shd->qhd", p, v)


def paged_case(rows, cached, heads, kv_heads, dim, dtype, seed):
    """q (Q, heads, dim), k_cache, v_cache, slots (S,): blocks scrambled, other slots NaN."""
    gen = torch.Generator().manual_seed(seed)
    S = cached + rows
    blocks = -(-S // BLOCK)
    order = torch.randperm(blocks + 3, generator=gen)  # a few spare blocks
    pos = torch.arange(S)
    slots = order[pos // BLOCK] * BLOCK + pos % BLOCK
    num_slots = len(order) * BLOCK
    k_cache = torch.randn(num_slots, kv_heads, dim, generator=gen)
    v_cache = torch.randn(num_slots, kv_heads, dim, generator=gen)
    unused = torch.ones(num_slots, dtype=torch.bool)
    unused[slots] = False
    k_cache[unused], v_cache[unused] = float("nan"), float("nan")
    q = torch.randn(rows, heads, dim, generator=gen)
    return q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), slots


def assert_matches(q, k_cache, v_cache, slots, scale=None):
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    out = cpu_paged_prefill_attention(q, k_cache, v_cache, slots, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all(), "NaN from a slot the sequence does not own leaked in"
    expected = reference(q, k_cache, v_cache, slots, scale)
    torch.testing.assert_close(out.float(), expected, atol=TOL[q.dtype], rtol=0)
    return out


@pytest.mark.parametrize(
    "rows, cached",
    [(1, 0), (1, 40), (5, 0), (16, 0), (17, 3), (37, 0), (40, 300), (300, 0), (70, 250)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_torch(rows, cached, dtype):
    assert_matches(*paged_case(rows, cached, 9, 3, 64, dtype, seed=rows + cached))


@pytest.mark.parametrize("heads, kv_heads, dim", [(4, 4, 64), (8, 2, 128), (6, 1, 16), (4, 2, 80)])
def test_head_layouts_and_sizes(heads, kv_heads, dim):
    """Plain MHA, a group of 4 (8 rows short of a tile multiple), one kv head for six,
    one vector per head, and 80 = 64 + 16 (a 4-vector value tile and a 1-vector one)."""
    assert_matches(*paged_case(23, 41, heads, kv_heads, dim, torch.float32, seed=dim))


@pytest.mark.parametrize(
    "rows, cached, heads, kv_heads, dim",
    [(37, 0, 9, 3, 64), (23, 41, 6, 1, 16), (17, 300, 4, 2, 80), (1, 254, 4, 2, 64)],
)
def test_bf16_through_the_register_tiles(rows, cached, heads, kv_heads, dim):
    """bf16 through the tiles even where the CPU has AMX (amx=False): in pairs where the
    build has AVX512-BF16, widened elsewhere; a scale of 1 and 1/sqrt(dim); any thread
    count gives the same bits. The last case fills a whole chunk with rows that are not a
    multiple of 16 lanes (36: the weights' pairs must not spill past their rows)."""
    q, k, v, slots = paged_case(rows, cached, heads, kv_heads, dim, torch.bfloat16, seed=dim)
    for scale in (1.0, dim**-0.5):
        out = cpu_paged_prefill_attention(q, k, v, slots, scale, amx=False)
        expected = reference(q, k, v, slots, scale)
        torch.testing.assert_close(out.float(), expected, atol=TOL[torch.bfloat16], rtol=0)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = cpu_paged_prefill_attention(q, k, v, slots, scale, amx=False)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, out)


def test_float16_where_supported():
    if not cpu_kernels_have(torch.float16):
        pytest.skip("this build of the native CPU kernels has no float16 (no _Float16)")
    assert_matches(*paged_case(20, 30, 4, 2, 64, torch.float16, seed=5))  # any error fails


def test_sharp_softmax_and_a_running_max_that_grows():
    """Large scores: every weight but the top ones underflows, and later chunks hold
    larger maxima than earlier ones, so the accumulator is rescaled on the way."""
    q, k, v, slots = paged_case(20, 600, 9, 3, 64, torch.float32, seed=8)
    k[slots] = k[slots] * torch.linspace(0.5, 3.0, len(slots))[:, None, None]
    assert_matches(q, k, v, slots, scale=1.0)


def test_layer_views_and_same_bits_for_any_thread_count():
    """A (layers, slots, kv_heads, dim) pool's layer view; 1 and 2 threads give equal bits."""
    q, k, v, slots = paged_case(300, 500, 9, 3, 64, torch.float32, seed=9)
    k_layers, v_layers = torch.stack([k, k * 0]), torch.stack([v * 0, v])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = assert_matches(q, k_layers[0], v_layers[1], slots)
        torch.set_num_threads(max(2, threads))
        multi = assert_matches(q, k_layers[0], v_layers[1], slots)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, multi)


def test_mixed_dtypes_under_inference_mode():
    q, k, v, slots = paged_case(33, 20, 8, 2, 64, torch.float32, seed=10)
    with torch.inference_mode():
        out = cpu_paged_prefill_attention(q.bfloat16(), k, v, slots, 0.125)
    expected = reference(q.bfloat16(), k, v, slots, 0.125)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=0)


def bad_inputs():
    q, k, v, slots = paged_case(8, 8, 4, 2, 64, torch.float32, seed=2)
    yield "Q, heads", (q[0], k, v, slots)
    yield "divisible", (q[:, :3], k, v, slots)
    yield "head_dim", (q, k[..., :32], v[..., :32], slots)
    yield "float32, bfloat16", (q.double(), k, v, slots)
    yield "int64", (q, k, v, slots.int())
    yield "S >= Q", (q, k, v, slots[:5])
    yield "S >= Q", (q, k, v, slots[None])
    yield "CPU", (q.to("meta"), k, v, slots)
    yield "multiple of 16", (q[..., :24], k[..., :24], v[..., :24], slots)
    yield "num_slots", (q, k, v, slots + k.shape[0])
    yield "num_slots", (q, k, v, slots - slots.max() - 1)


@pytest.mark.parametrize("match, args", list(bad_inputs()))
def test_bad_inputs_raise(match, args):
    with pytest.raises(ValueError, match=match):
        cpu_paged_prefill_attention(*args, 0.125)


OWN_THREADS = """
import sys, torch
sys.path.insert(0, {tests!r})
from kvlab.kernels.cpu_build import cpu_kernels_threads
from test_cpu_prefill import both_kernels
assert cpu_kernels_threads() == "own", cpu_kernels_threads()
torch.save(both_kernels(), {path!r})
"""


def both_kernels():
    """The prompt and decode kernels' outputs on one seeded case, on two threads."""
    q, k, v, slots = paged_case(300, 200, 9, 3, 64, torch.float32, seed=12)
    torch.set_num_threads(2)
    prompt = cpu_paged_prefill_attention(q, k, v, slots, 0.125)
    lens = torch.tensor([len(slots), 100, 457])
    decode = cpu_paged_decode_attention(q[:3], k, v, slots.expand(3, -1), lens, 0.125)
    return prompt, decode


def test_torch_openmp_threads_and_our_own_give_the_same_bits(tmp_path):
    """Where torch runs on OpenMP (Linux) the kernels run on its threads; with
    KVLAB_CPU_THREADS=own on the library's pthreads. Either way, the same bits."""
    if sys.platform == "linux" and torch.backends.openmp.is_available():
        assert cpu_kernels_threads() == "openmp"
    threads = torch.get_num_threads()
    try:
        here = both_kernels()
    finally:
        torch.set_num_threads(threads)
    path = tmp_path / "own.pt"
    code = OWN_THREADS.format(tests=str(Path(__file__).parent), path=str(path))
    env = {**os.environ, "KVLAB_CPU_THREADS": "own"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=300)
    for mine, theirs in zip(here, torch.load(path)):
        assert torch.equal(mine, theirs)


@pytest.mark.parametrize("flags", [(), ("-march=native",)], ids=["plain", "native"])
def test_prefill_pays_asks_the_build_not_the_cpu(tmp_path, flags):
    """The tiles' width is fixed when the library compiles (cpu_common.h), so the build
    says whether they fit: with -march=native where the CPU has AVX-512, or AVX2 with FMA;
    a plain x86-64 build (cpu_build's fallback without -march=native) has neither. The AMX
    kernels' readiness is the CPU's in either build."""
    import ctypes

    from kvlab.kernels import cpu_build

    if os.uname().machine != "x86_64":
        pytest.skip("the flags checked here are x86-64's")
    target = tmp_path / "kernels.so"
    error = cpu_build._compile(cpu_build._compiler(), ("-O0", *flags, "-shared", "-fPIC",
                                                       "-pthread"), target)  # fmt: skip
    assert error is None, error
    fit = ctypes.CDLL(str(target)).kvlab_prefill_tiles_fit()
    cpu = cpu_build.cpu_flags()
    assert fit == (bool(flags) and ("avx512f" in cpu or {"avx2", "fma"} <= cpu))
    # cpu_amx.c compiles for any x86-64 target; kvlab_amx_ready asks the CPU either way
    amx = {"amx_bf16", "amx_tile", "avx512f", "avx512bw", "avx512_bf16"} <= cpu
    assert ctypes.CDLL(str(target)).kvlab_amx_ready() == amx
    if flags == ("-march=native",):  # the library kvlab loads is this build
        from kvlab.kernels.cpu_prefill import prefill_pays

        assert prefill_pays() == bool(fit)
