"""KV write: scatter the new tokens' K/V into their pool slots, quantizing on the way.

One program per new token: for each kv head it reads the head_dim vector of K (and of V),
finds its absolute maximum, stores the bf16 scale beside the slot and the codes in it.
The layout is kvlab.cache.codecs' (see kv_codes.py), so the pool reads it back unchanged.

    k, v:           (T, kv_heads, head_dim)   the step's new keys and values
    k_cache/v_cache (num_slots, kv_heads, head_dim)  floats, int8 codes or fp8 bits (uint8)
    k_scale/v_scale (num_slots, kv_heads)     bf16, for int8 / fp8 only
    slot_mapping    (T,)                      the slot each new token goes to

Unlike the codec's torch path, nothing here checks for NaN/inf (that would cost a sync
with the host every layer): the input must be finite.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kv_codes import (
    BF16_TINY,
    SCALED,
    TOPS,
    codec_id,
    encode_ref,
    fp8_bits,
    round_half_even,
    round_to_bf16,
)


def kv_write_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    kv_codec: str | None = None,
) -> None:
    """Plain torch: encode like kvlab.cache.codecs, then index_copy_ into the slots."""
    _check(k, k_cache, k_scale, kv_codec)
    slots = slot_mapping.long()
    for x, cache, scales in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        codes, s = encode_ref(x, kv_codec, cache.dtype)
        cache.index_copy_(0, slots, codes)
        if s is not None:
            scales.index_copy_(0, slots, s)


@triton.jit
def _encode_store(x, dst, scale_dst, mask, hmask, CODEC: tl.constexpr, TOP: tl.constexpr, TINY):
    """Store x (KVH_PAD, D_PAD), one row per kv head, at `dst`: cast, or codes + scales."""
    if CODEC == 0:
        if dst.dtype.element_ty == tl.bfloat16:  # round to nearest even, even interpreted
            x = x.to(tl.float32)
            x = tl.where(tl.abs(x) < float("inf"), round_to_bf16(x), x)
        tl.store(dst, x.to(dst.dtype.element_ty), mask=mask)
    else:
        x = x.to(tl.float32)
        amax = tl.max(tl.abs(x), axis=1)  # (KVH_PAD,)
        s = tl.maximum(tl.math.div_rn(amax, TOP), TINY)
        s = round_to_bf16(tl.where(amax > 0, s, 0.0))  # the scale as stored
        sf = s[:, None]
        y = tl.where(sf > 0, tl.math.div_rn(x, tl.where(sf > 0, sf, 1.0)), 0.0)
        if CODEC == 1:
            code = tl.minimum(tl.maximum(round_half_even(y), -127.0), 127.0).to(tl.int8)
        elif CODEC == 2:
            code = fp8_bits(tl.minimum(tl.maximum(y, -TOP), TOP), 3, 7).to(tl.uint8)
        else:
            code = fp8_bits(tl.minimum(tl.maximum(y, -TOP), TOP), 2, 15).to(tl.uint8)
        tl.store(dst, code, mask=mask)
        tl.store(scale_dst, s.to(tl.bfloat16), mask=hmask)


@triton.jit
def _kv_write_kernel(
    k_ptr,  # (T, kv_heads, head_dim) new keys
    v_ptr,  # (T, kv_heads, head_dim) new values
    slot_ptr,  # (T,) destination slots
    kc_ptr,  # (num_slots, kv_heads, head_dim) K cache: floats or codes
    vc_ptr,  # (num_slots, kv_heads, head_dim) V cache
    ks_ptr,  # (num_slots, kv_heads) bf16 K scales; unused for float storage
    vs_ptr,  # (num_slots, kv_heads) bf16 V scales
    stride_xt,  # new K and V share strides
    stride_xh,
    stride_cs,  # K and V caches share strides
    stride_ch,
    stride_ss,  # so do the scales
    stride_sh,
    TINY,
    KVH: tl.constexpr,
    KVH_PAD: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    CODEC: tl.constexpr,  # 0 float storage, 1 int8, 2 fp8 e4m3, 3 fp8 e5m2
    TOP: tl.constexpr,
):
    t = tl.program_id(0)  # one new token per program, all its kv heads
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, KVH_PAD)
    d = tl.arange(0, D_PAD)
    hmask = h < KVH
    mask = hmask[:, None] & (d < D)[None, :]
    src = t * stride_xt + h[:, None] * stride_xh + d[None, :]  # (KVH_PAD, D_PAD)
    dst = slot * stride_cs + h[:, None] * stride_ch + d[None, :]
    scale_at = slot * stride_ss + h * stride_sh  # (KVH_PAD,)
    k = tl.load(k_ptr + src, mask=mask, other=0.0)
    v = tl.load(v_ptr + src, mask=mask, other=0.0)
    _encode_store(k, kc_ptr + dst, ks_ptr + scale_at, mask, hmask, CODEC, TOP, TINY)
    _encode_store(v, vc_ptr + dst, vs_ptr + scale_at, mask, hmask, CODEC, TOP, TINY)


_KERNELS = (_kv_write_kernel,)  # dispatch checks how they were built


def kv_write_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    kv_codec: str | None = None,
) -> None:
    """The Triton kernel: same arguments and result as kv_write_ref."""
    _check(k, k_cache, k_scale, kv_codec)
    tokens, heads, dim = k.shape
    if tokens == 0:
        return
    if k.stride() != v.stride() or k.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    scaled = kv_codec in SCALED
    if v_cache.stride() != k_cache.stride() or (scaled and v_scale.stride() != k_scale.stride()):
        raise ValueError("the K and V caches (and their scales) need the same strides")
    ks = k_scale if scaled else k_cache  # any tensor: the kernel never touches it
    vs = v_scale if scaled else v_cache
    _kv_write_kernel[(tokens,)](
        k,
        v,
        slot_mapping,
        k_cache,
        v_cache,
        ks,
        vs,
        k.stride(0),
        k.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        ks.stride(0),
        ks.stride(1),
        BF16_TINY,
        KVH=heads,
        KVH_PAD=triton.next_power_of_2(heads),
        D=dim,
        D_PAD=triton.next_power_of_2(dim),
        CODEC=codec_id(kv_codec),
        TOP=TOPS.get(kv_codec, 1.0),
        num_warps=1,
    )


def _check(
    k: torch.Tensor, cache: torch.Tensor, scales: torch.Tensor | None, kv_codec: str | None
) -> None:
    codec_id(kv_codec)
    if cache.dim() != 3 or cache.shape[1:] != k.shape[1:] or cache.stride(-1) != 1:
        raise ValueError(
            f"cache of shape {tuple(cache.shape)} must be (num_slots, {k.shape[1]}, "
            f"{k.shape[2]}) with a contiguous last dim, like the new K/V {tuple(k.shape)}"
        )
    if kv_codec in SCALED:
        if scales is None or scales.dtype != torch.bfloat16:
            raise ValueError(f"kv_codec={kv_codec!r} needs bf16 scales (num_slots, kv_heads)")
        want = torch.int8 if kv_codec == "int8" else torch.uint8
        if cache.dtype != want:
            raise ValueError(f"kv_codec={kv_codec!r} stores {want} codes, not {cache.dtype}")
