"""kvlab.kernels.cpu_paged_decode_attention (the native CPU kernel) against plain torch.

The reference gathers each sequence's slots and runs softmax(q k^T * scale) v per head in
fp32. The caches are laid out like a paged cache with its blocks in random order, and every
slot no sequence uses holds NaN, so reading past a sequence's length would show.

Tolerances: fp32 2e-5 absolute. bf16 (q and cache): 2e-2 absolute against the reference on
the same bf16 values in fp32 math, which the kernel matches up to rounding its output to bf16.
"""

from __future__ import annotations

import math

import pytest
import torch
from kvlab.kernels import cpu_kernels_available, cpu_paged_decode_attention
from kvlab.kernels.cpu_build import cpu_kernels_error, cpu_kernels_have

BLOCK = 16
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.fixture(autouse=True)
def _needs_kernel():
    if not cpu_kernels_available():
        pytest.skip(f"the CPU decode kernel is unavailable: {cpu_kernels_error()}")


def reference(q, k_cache, v_cache, slots, lens, scale):
    """Gather each sequence's slots; fp32 softmax attention per head (GQA)."""
    group = q.shape[1] // k_cache.shape[1]
    out = torch.empty(q.shape)
    for b, n in enumerate(lens.tolist()):
        k = k_cache[slots[b, :n]].float().repeat_interleave(group, dim=1)  # (n, heads, D)
        v = v_cache[slots[b, :n]].float().repeat_interleave(group, dim=1)
        p = (torch.einsum("hd,nhd->hn", q[b].float(), k) * scale).softmax(-1)
        out[b] = torch.einsum("hn,nhd->hd", p, v)
    return out


def paged_case(batch, heads, kv_heads, dim, dtype, seed, max_len=300):
    """q, k_cache, v_cache, slots, lens: blocks in random order, unused slots NaN."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_len + 1, (batch,), generator=gen)
    span = int(lens.max())
    per_seq = -(-span // BLOCK)
    order = torch.randperm(batch * per_seq + 5, generator=gen)  # a few spare blocks
    tables = order[: batch * per_seq].view(batch, per_seq)
    pos = torch.arange(span)
    slots = tables[:, pos // BLOCK] * BLOCK + pos % BLOCK  # (B, S)
    num_slots = len(order) * BLOCK
    k_cache = torch.randn(num_slots, kv_heads, dim, generator=gen)
    v_cache = torch.randn(num_slots, kv_heads, dim, generator=gen)
    unused = torch.ones(num_slots, dtype=torch.bool)
    unused[slots[pos[None, :] < lens[:, None]]] = False
    k_cache[unused], v_cache[unused] = float("nan"), float("nan")
    q = torch.randn(batch, heads, dim, generator=gen)
    return q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), slots, lens


def assert_matches(q, k_cache, v_cache, slots, lens, scale=None, tol=None):
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    out = cpu_paged_decode_attention(q, k_cache, v_cache, slots, lens, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all(), "NaN from an unused slot leaked in"
    expected = reference(q, k_cache, v_cache, slots, lens, scale)
    atol = TOL[q.dtype] if tol is None else tol
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=0)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (4, 4), (8, 2)])
@pytest.mark.parametrize("dim", [64, 128])
def test_matches_torch(dtype, heads, kv_heads, dim):
    for seed, batch in enumerate([1, 3, 6]):
        assert_matches(*paged_case(batch, heads, kv_heads, dim, dtype, seed))


@pytest.mark.parametrize("dim", [1, 24, 72, 256])
def test_head_dims_off_the_vector_width(dim):
    assert_matches(*paged_case(4, 8, 2, dim, torch.float32, seed=dim))


def test_short_contexts_and_sharp_softmax():
    q, k, v, slots, lens = paged_case(5, 4, 2, 64, torch.float32, seed=7, max_len=3)
    assert_matches(q, k, v, slots, lens)
    q, k, v, slots, lens = paged_case(5, 4, 2, 64, torch.float32, seed=8)
    assert_matches(q, k, v, slots, lens, scale=3.0, tol=1e-4)  # scores ~ N(0, 576)


def test_layer_views_and_sliced_slots():
    q, k, v, slots, lens = paged_case(4, 9, 3, 64, torch.float32, seed=11)
    # one layer of a (layers, slots, kv_heads, head_dim) tensor stored slot-major
    storage = torch.randn(k.shape[0], 3, 3, 64).transpose(0, 1)
    storage[1] = k
    k_view = storage[1]
    v_wide = torch.full((v.shape[0], 3, 128), float("nan"))
    v_wide[..., :64] = v
    v_view = v_wide[..., :64]  # head stride 128
    assert not k_view.is_contiguous() and not v_view.is_contiguous()
    wide = torch.full((4, slots.shape[1] + 9), -1)
    sliced = wide[:, 4 : 4 + slots.shape[1]]  # row stride S + 9
    sliced.copy_(slots)
    sliced[torch.arange(slots.shape[1]) >= lens[:, None]] = -1  # past each length: never read
    expected = assert_matches(q, k, v, slots, lens)
    torch.testing.assert_close(assert_matches(q, k_view, v_view, sliced, lens), expected)


def test_threads_inference_mode_and_mixed_dtypes():
    q, k, v, slots, lens = paged_case(6, 8, 2, 128, torch.bfloat16, seed=3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = cpu_paged_decode_attention(q, k, v, slots, lens, 0.1)
        torch.set_num_threads(max(2, threads))
        with torch.inference_mode():
            multi = cpu_paged_decode_attention(q, k, v, slots, lens, 0.1)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, multi)  # one thread per task: the same sums in any split
    assert_matches(q.float(), k, v, slots, lens, tol=2e-5)  # fp32 q, bf16 cache


def test_float16_where_supported():
    if not cpu_kernels_have(torch.float16):
        pytest.skip("this build of the native CPU kernels has no float16 (no _Float16)")
    q, k, v, slots, lens = paged_case(3, 8, 2, 64, torch.float16, seed=5)
    assert_matches(q, k, v, slots, lens)  # any ValueError here is a failure


def test_empty_batch():
    q, k, v, slots, lens = paged_case(2, 4, 2, 64, torch.float32, seed=1)
    out = cpu_paged_decode_attention(q[:0], k, v, slots[:0], lens[:0], 0.125)
    assert out.shape == (0, 4, 64)


def bad_inputs():
    q, k, v, slots, lens = paged_case(2, 4, 2, 64, torch.float32, seed=2)
    too_long, far_slot = lens.clone(), slots.clone()
    too_long[1] = slots.shape[1] + 1
    far_slot[0, 0] = k.shape[0]
    yield "B, heads", (q[0], k, v, slots, lens)
    yield "divisible", (q[:, :3], k, v, slots, lens)
    yield "head_dim", (q, k[..., :32], v[..., :32], slots, lens)
    yield "same", (q, k, v[:, :1], slots, lens)
    yield "float32, bfloat16", (q.double(), k, v, slots, lens)
    yield "k and v alike", (q, k, v.bfloat16(), slots, lens)
    yield "int64", (q, k, v, slots.int(), lens)
    yield "lens", (q, k, v, slots, lens[:1])
    yield "CPU", (q.to("meta"), k, v, slots, lens)
    yield r"\[1, S\]", (q, k, v, slots, too_long)
    yield r"\[1, S\]", (q, k, v, slots, lens * 0)
    yield "num_slots", (q, k, v, far_slot, lens)
    yield "num_slots", (q, k, v, slots - slots.max() - 1, lens)


@pytest.mark.parametrize("match, args", list(bad_inputs()))
def test_bad_inputs_raise(match, args):
    with pytest.raises(ValueError, match=match):
        cpu_paged_decode_attention(*args, 0.125)


def test_long_ragged_sequences_split_into_chunks():
    """Sequences past one task's 256 positions are merged from chunks, the same in any split."""
    q, k, v, slots, lens = paged_case(5, 9, 3, 64, torch.float32, seed=13, max_len=1500)
    lens[0], lens[1] = 256, 257  # exactly one chunk, and one position into a second
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = assert_matches(q, k, v, slots, lens)
        torch.set_num_threads(max(2, threads))
        multi = assert_matches(q, k, v, slots, lens)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, multi)
    assert_matches(*paged_case(3, 8, 2, 128, torch.bfloat16, seed=14, max_len=900))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunks_read_through_the_same_slots_are_read_once_with_the_same_bits(dtype):
    """A shared prompt prefix: sequences whose first positions are the same slots (all 20
    share 300, past one 256-position chunk and past the 16 sequences one task serves; pairs
    share 700, a second chunk) give the bits each gives alone, against the reference."""
    q, k, v, slots, lens = paged_case(20, 9, 3, 64, dtype, seed=15, max_len=1100)
    lens = lens.clamp(min=720)
    lens[3] = 512  # a whole second chunk and no third
    slots[:, :300] = slots[0, :300]
    slots[1::2, 300:700] = slots[0::2, 300:700]  # each odd sequence shares its pair's
    used = torch.zeros(k.shape[0], dtype=torch.bool)
    used[slots[torch.arange(slots.shape[1])[None, :] < lens[:, None]]] = True
    gen = torch.Generator().manual_seed(16)
    k, v = (torch.randn(k.shape, generator=gen).to(dtype) for _ in range(2))
    k[~used], v[~used] = float("nan"), float("nan")
    together = assert_matches(q, k, v, slots, lens)
    one = [slice(b, b + 1) for b in range(20)]
    alone = [cpu_paged_decode_attention(q[b], k, v, slots[b], lens[b], 0.125) for b in one]
    assert torch.equal(together, torch.cat(alone))
