"""Paged decode attention: one new query token per sequence, K/V read through the block table.

Decode is memory-bound: every step reads each sequence's whole cached K/V once and does
two small dot products with it. So the kernel's job is to stream K/V from wherever the
block table says they live, at close to the memory's bandwidth, and touch nothing twice:

* **GQA.** One program serves one kv head and all `group = heads // kv_heads` query heads
  that share it: each K/V tile is loaded once and used `group` times.
* **The block table walk.** Token position p of sequence b is in logical block
  p // block_size, i.e. physical block `block_tables[b, p // block_size]`, slot
  `block * block_size + p % block_size`. A tile of TILE positions gathers its TILE rows
  this way (`walk` below does the same in plain Python, for the notebook's diagram).
* **Online softmax.** Scores are never stored: each tile updates a running max `m`, a
  running sum `l` and the weighted sum of V, rescaling the old ones (flash attention).
* **Split-K (flash-decoding).** With few sequences, B x kv_heads programs cannot keep the
  GPU busy on a long context. The context is then cut into `num_splits` chunks, one
  program each, which write a partial output and its log-sum-exp; a second small kernel
  merges the chunks: out = sum_i w_i o_i / sum_i w_i, with w_i = exp(lse_i - max lse).
* **Fused dequantization.** int8/fp8 codes go into the dot products as they are (every
  code is exact in bf16/fp16/fp32); each token's scale multiplies its score (K) or its
  probability (V). No dequantized copy of K/V is ever written.

Shapes: q (B, heads, head_dim); k_cache, v_cache (num_slots, kv_heads, head_dim) (a
layer of KVPool's storage; a (num_blocks, block_size, kv_heads, head_dim) view works
too); k_scale, v_scale (num_slots, kv_heads) bf16 for int8/fp8; block_tables
(B, max_blocks) int; context_lens (B,) int, each >= 1. Output (B, heads, head_dim) in
q's dtype.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .kv_codes import SCALED, codec_id, decode_ref, fp8_to_half

LOG2E = 1.4426950408889634
MIN_SPLIT_TOKENS = 256  # auto split-K never cuts the context finer than this


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    block_size: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    kv_codec: str | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Plain torch: gather every context slot, decode like kvlab.cache.codecs, softmax.

    Decoded K/V are in q's dtype (as the pool's gather returns them); the attention
    itself runs in fp32. `num_splits` is accepted for the kernel's signature and
    ignored: splitting changes the order of the sums, not the result.
    """
    _check(q, k_cache, v_cache, k_scale, block_tables, kv_codec)
    k_cache, v_cache = _flat(k_cache), _flat(v_cache)
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    span = block_tables.shape[1] * block_size
    pos = torch.arange(span, device=q.device)  # (S,)
    tables = block_tables.long()
    slots = tables[:, pos // block_size] * block_size + pos % block_size  # (B, S)
    valid = pos[None, :] < context_lens.long()[:, None]  # (B, S)
    slots = torch.where(valid, slots, 0)  # never read past a sequence's end

    def gather(cache: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
        codes = cache[slots]  # (B, S, kv_heads, head_dim)
        s = scales[slots] if kv_codec in SCALED else None  # (B, S, kv_heads)
        x = decode_ref(codes, s, kv_codec, q.dtype).float()
        x = torch.where(valid[:, :, None, None], x, 0.0)  # whatever sits in slot 0
        return x.repeat_interleave(heads // kv_heads, dim=2)  # (B, S, heads, head_dim)

    k, v = gather(k_cache, k_scale), gather(v_cache, v_scale)
    scores = torch.einsum("bhd,bshd->bhs", q.float(), k) * scale  # (B, heads, S)
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    out = torch.einsum("bhs,bshd->bhd", scores.softmax(-1), v)
    return out.to(q.dtype)


@triton.jit
def _load_tile(cache_ptr, offs, mask, CODEC: tl.constexpr):
    """A (TILE, D_PAD) tile of K or V as floats: stored floats, or the codes' values."""
    raw = tl.load(cache_ptr + offs, mask=mask, other=0)
    if CODEC == 0:
        x = raw
    elif CODEC == 1:
        x = raw.to(tl.float32)  # int8 codes
    else:
        x = fp8_to_half(raw, CODEC == 3)
    return x


@triton.jit
def _load_factor(scale_ptr, offs, mask, CODEC: tl.constexpr):
    """Each token's dequantization factor (TILE,): its bf16 scale, x 256 for e4m3."""
    s = tl.load(scale_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if CODEC == 2:
        s = s * 256.0  # fp8_to_half gives e4m3 codes as value * 2**-8
    return s


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b with fp32 accumulation; exact fp32 products when IEEE (no tf32)."""
    if IEEE:
        c = tl.dot(a, b, input_precision="ieee")
    else:
        c = tl.dot(a, b)
    return c


@triton.jit
def _decode_kernel(
    q_ptr,  # (B, heads, head_dim)
    k_ptr,  # (num_slots, kv_heads, head_dim): floats or codes
    v_ptr,
    ks_ptr,  # (num_slots, kv_heads) bf16 scales (int8 / fp8 only)
    vs_ptr,
    table_ptr,  # (B, max_blocks) physical block of each logical block
    lens_ptr,  # (B,) context length
    out_ptr,  # (B, heads, head_dim), or (B, heads, splits, head_dim) fp32 partials
    lse_ptr,  # (B, heads, splits) fp32 log2-sum-exp of each split (split mode only)
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    chunk,  # context positions per split
    stride_qb,
    stride_qh,
    stride_cs,  # K and V caches share strides
    stride_ch,
    stride_ss,  # so do their scales
    stride_sh,
    stride_tb,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    GROUP: tl.constexpr,  # query heads per kv head
    GROUP_PAD: tl.constexpr,  # >= 16: tl.dot's smallest tile
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,  # context positions per loop step
    CODEC: tl.constexpr,  # 0 float storage, 1 int8, 2 fp8 e4m3, 3 fp8 e5m2
    SPLIT: tl.constexpr,  # write partials + lse for _reduce_kernel, not the output
    IEEE: tl.constexpr,  # fp32 inputs: exact products in tl.dot, not tf32
):
    b, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    gmask, dmask = g < GROUP, d < D
    heads = kvh * GROUP + g  # the query heads that share this kv head
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=gmask[:, None] & dmask[None, :],
        other=0.0,
    )  # (GROUP_PAD, D_PAD)

    context = tl.load(lens_ptr + b)
    start = split * chunk
    end = tl.minimum(start + chunk, context)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max (base-2 scores)
    total = tl.zeros([GROUP_PAD], tl.float32)  # running sum of exp2(score - m)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)  # running sum of p * v
    for tile_start in range(start, end, TILE):
        pos = tile_start + tl.arange(0, TILE)
        valid = pos < end
        # The block table walk: position -> logical block -> physical block -> slot.
        block = tl.load(table_ptr + b * stride_tb + pos // BLOCK_SIZE, mask=valid, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE  # (TILE,)
        offs = slot[:, None] * stride_cs + kvh * stride_ch + d[None, :]  # (TILE, D_PAD)
        tile_mask = valid[:, None] & dmask[None, :]
        scale_offs = slot * stride_ss + kvh * stride_sh  # (TILE,)

        k = _load_tile(k_ptr, offs, tile_mask, CODEC).to(q.dtype)  # (TILE, D_PAD)
        s = _dot(q, tl.trans(k), IEEE)  # (GROUP_PAD, TILE) fp32
        if CODEC != 0:
            s = s * _load_factor(ks_ptr, scale_offs, valid, CODEC)[None, :]
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))

        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)  # rescales what was summed under the old max
        p = tl.exp2(s - m_new[:, None])  # (GROUP_PAD, TILE)
        total = total * alpha + tl.sum(p, axis=1)
        v = _load_tile(v_ptr, offs, tile_mask, CODEC).to(q.dtype)
        if CODEC != 0:
            p = p * _load_factor(vs_ptr, scale_offs, valid, CODEC)[None, :]
        acc = acc * alpha[:, None] + _dot(p.to(q.dtype), v, IEEE)
        m = m_new

    out = acc / tl.where(total > 0, total, 1.0)[:, None]  # an empty split leaves 0
    heads_mask = gmask[:, None] & dmask[None, :]
    if SPLIT:
        dst = out_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os
        tl.store(dst + d[None, :], out, mask=heads_mask)
        lse = tl.where(total > 0, m + tl.log2(tl.where(total > 0, total, 1.0)), float("-inf"))
        tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=gmask)
    else:
        dst = out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=heads_mask)


@triton.jit
def _reduce_kernel(
    part_ptr,  # (B, heads, splits, head_dim) fp32
    lse_ptr,  # (B, heads, splits) fp32
    out_ptr,  # (B, heads, head_dim)
    splits,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    """Merge the splits of one (sequence, head): weights 2**(lse_i - max lse)."""
    b, h = tl.program_id(0), tl.program_id(1)
    i = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, D_PAD)
    lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + i, mask=i < splits, other=-float("inf"))
    w = tl.exp2(lse - tl.max(lse, axis=0))  # (SPLITS_PAD,), 0 for empty splits
    parts = tl.load(
        part_ptr + b * stride_pb + h * stride_ph + i[:, None] * stride_ps + d[None, :],
        mask=(i[:, None] < splits) & (d[None, :] < D),
        other=0.0,
    )  # (SPLITS_PAD, D_PAD)
    out = tl.sum(parts * w[:, None], axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), d < D)


_KERNELS = (_decode_kernel, _reduce_kernel)  # dispatch checks how they were built


def auto_splits(batch: int, kv_heads: int, max_context: int, device: torch.device) -> int:
    """Split-K only when B x kv_heads programs would leave the GPU idle: aim for ~4
    programs per multiprocessor, in chunks of at least MIN_SPLIT_TOKENS positions."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    wanted = math.ceil(4 * sms / (batch * kv_heads))
    return max(1, min(wanted, math.ceil(max_context / MIN_SPLIT_TOKENS)))


def paged_decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    block_size: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    kv_codec: str | None = None,
    num_splits: int | None = None,
    *,
    tile: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """The Triton kernel: same arguments and result as paged_decode_attention_ref.

    `num_splits` None picks one (auto_splits) from the table's width, which bounds the
    longest context without reading context_lens back to the host. `tile`, `num_warps`,
    `num_stages` are tuning knobs (benchmarks/gpu_check.py sweeps them).
    """
    _check(q, k_cache, v_cache, k_scale, block_tables, kv_codec)
    k_cache, v_cache = _flat(k_cache), _flat(v_cache)
    if q.stride(-1) != 1:
        q = q.contiguous()
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    span = block_tables.shape[1] * block_size  # >= every context length
    splits = num_splits or auto_splits(batch, kv_heads, span, q.device)
    if tile is None:
        tile = 64 if kv_codec in SCALED else 32
    chunk = triton.cdiv(triton.cdiv(span, splits), tile) * tile
    scaled = kv_codec in SCALED
    ks = k_scale if scaled else k_cache  # any tensor: the kernel never reads it
    vs = v_scale if scaled else v_cache
    out = torch.empty_like(q)
    if splits > 1:
        part = torch.empty(batch, heads, splits, dim, device=q.device, dtype=torch.float32)
        lse = torch.empty(batch, heads, splits, device=q.device, dtype=torch.float32)
    else:
        part, lse = out, out  # written straight to the output; lse unused
    _decode_kernel[(batch, kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        ks,
        vs,
        block_tables,
        context_lens,
        part,
        lse,
        scale * LOG2E,
        chunk,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        ks.stride(0),
        ks.stride(1),
        block_tables.stride(0),
        part.stride(0),
        part.stride(1),
        part.stride(2) if splits > 1 else 0,
        lse.stride(0),
        lse.stride(1),
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        D=dim,
        D_PAD=max(16, triton.next_power_of_2(dim)),
        BLOCK_SIZE=block_size,
        TILE=tile,
        CODEC=codec_id(kv_codec),
        SPLIT=splits > 1,
        IEEE=q.dtype == torch.float32,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if splits > 1:
        _reduce_kernel[(batch, heads)](
            part,
            lse,
            out,
            splits,
            part.stride(0),
            part.stride(1),
            part.stride(2),
            lse.stride(0),
            lse.stride(1),
            out.stride(0),
            out.stride(1),
            D=dim,
            D_PAD=triton.next_power_of_2(dim),
            SPLITS_PAD=triton.next_power_of_2(splits),
            num_warps=1,
        )
    return out


def walk(
    block_tables: list[list[int]],
    context_lens: list[int],
    block_size: int,
    tile: int,
    num_splits: int = 1,
) -> list[dict]:
    """What each kernel program reads, in plain Python: one row per context position.

    Same arithmetic as _decode_kernel (one kv head): program (b, split) covers positions
    [split * chunk, min((split + 1) * chunk, context)) in tiles of `tile` positions, and
    position p reads slot block_tables[b][p // block_size] * block_size + p % block_size.
    """
    span = max(len(t) for t in block_tables) * block_size
    chunk = math.ceil(math.ceil(span / num_splits) / tile) * tile
    rows = []
    for b, (table, context) in enumerate(zip(block_tables, context_lens)):
        for p in range(context):
            split = p // chunk
            rows.append(
                {
                    "seq": b,
                    "pos": p,
                    "split": split,
                    "tile": (p - split * chunk) // tile,
                    "logical_block": p // block_size,
                    "block": table[p // block_size],
                    "slot": table[p // block_size] * block_size + p % block_size,
                }
            )
    return rows


def _flat(cache: torch.Tensor) -> torch.Tensor:
    """(num_blocks, block_size, kv_heads, head_dim) -> (num_slots, kv_heads, head_dim)."""
    return cache.flatten(0, 1) if cache.dim() == 4 else cache


def _check(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    block_tables: torch.Tensor,
    kv_codec: str | None,
) -> None:
    codec_id(kv_codec)
    cache = _flat(k_cache)
    if q.dim() != 3 or cache.dim() != 3 or q.shape[2] != cache.shape[2]:
        raise ValueError(
            f"q {tuple(q.shape)} must be (B, heads, head_dim) and the cache "
            f"{tuple(k_cache.shape)} (num_slots, kv_heads, head_dim) with the same head_dim"
        )
    if cache.stride(-1) != 1 or _flat(v_cache).stride() != cache.stride():
        raise ValueError("K and V caches need the same strides and a contiguous head_dim")
    if q.shape[1] % cache.shape[1]:
        raise ValueError(f"heads={q.shape[1]} is not a multiple of kv_heads={cache.shape[1]}")
    if block_tables.dim() != 2 or block_tables.shape[0] != q.shape[0]:
        raise ValueError(f"block_tables {tuple(block_tables.shape)} must be (B={q.shape[0]}, n)")
    if kv_codec in SCALED and (k_scale is None or k_scale.dtype != torch.bfloat16):
        raise ValueError(f"kv_codec={kv_codec!r} needs bf16 scales (num_slots, kv_heads)")
