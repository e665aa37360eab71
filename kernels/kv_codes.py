"""The bit layouts of kvlab's scaled KV codecs, in Triton and in plain torch.

Same math as `kvlab.cache.codecs` (Int8, FP8E4M3, FP8E5M2), bit for bit, so a pool written
by a kernel reads back through the codec and the other way round:

    scale s = bf16(amax / top), 0 for an all-zero head       (one per token per kv head)
    int8:   code = clamp(round_half_even(x / s), -127, 127)   (top = 127)
    fp8:    code = bits of fp8(clamp(x / s, -top, top))       (top = 448 or 57344)

The Triton helpers do every rounding step by hand (IEEE division, round-half-even, fp8
encoding on the fp32 bits, bf16 rounding) instead of trusting a backend's fast paths: the
GPU's `/` is an approximate division, and Triton's interpreter flushes fp8 subnormals to
zero and truncates to bf16.

No kvlab import here: the kernels load on a GPU machine with torch and triton alone.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SCALE_DTYPE = torch.bfloat16
FLOAT_STORAGE = (None, "fp16", "bf16")  # stored as floats: no scales, nothing to decode
SCALED = ("int8", "fp8_e4m3", "fp8_e5m2")  # codes + one bf16 scale per token per kv head
# codec name -> kernel constexpr CODEC
CODEC_IDS = {None: 0, "fp16": 0, "bf16": 0, "int8": 1, "fp8_e4m3": 2, "fp8_e5m2": 3}
FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
TOPS = {"int8": 127.0, "fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}
BF16_TINY = torch.finfo(torch.bfloat16).tiny  # smallest normal bf16: a scale never flushes


def codec_id(kv_codec: str | None) -> int:
    if kv_codec not in CODEC_IDS:
        raise ValueError(
            f"kv_codec={kv_codec!r} has no kernel; kernels handle {list(CODEC_IDS)} "
            "(int4 and kivi2 stay on the torch path)"
        )
    return CODEC_IDS[kv_codec]


# --- torch: the reference encode / decode (what kvlab.cache.codecs does) -----------------
def encode_ref(x: torch.Tensor, kv_codec: str | None, storage: torch.dtype):
    """(T, kv_heads, head_dim) -> (codes in `storage`, bf16 scales (T, kv_heads) or None)."""
    if kv_codec not in SCALED:
        return x.to(storage), None
    top = TOPS[kv_codec]
    x = x.float()
    s = (x.abs().amax(-1) / top).clamp(min=BF16_TINY)
    s = torch.where(x.abs().amax(-1) > 0, s, 0.0).to(SCALE_DTYPE)  # (T, kv_heads)
    sf = s.float()[..., None]
    y = torch.where(sf > 0, x / sf, 0.0)
    if kv_codec == "int8":
        return y.round().clamp(-127, 127).to(torch.int8), s
    return y.clamp(-top, top).to(FP8_DTYPES[kv_codec]).view(torch.uint8), s


def decode_ref(
    codes: torch.Tensor, scales: torch.Tensor | None, kv_codec: str | None, dtype: torch.dtype
) -> torch.Tensor:
    """Inverse of encode_ref, into `dtype`: codes (..., head_dim), scales (...)."""
    if kv_codec not in SCALED:
        return codes.to(dtype)
    values = codes.float() if kv_codec == "int8" else codes.view(FP8_DTYPES[kv_codec]).float()
    return (values * scales.float()[..., None]).to(dtype)


# --- Triton: the same steps inside a kernel ------------------------------------------------
@triton.jit
def round_half_even(y):
    """torch.round: to the nearest integer, ties to even (exact for |y| < 2**23)."""
    a = tl.abs(y)
    r = tl.floor(a)
    d = a - r  # exact: r and a share a binade, or r is 0
    odd = (r.to(tl.int32) & 1) == 1
    r = tl.where((d > 0.5) | ((d == 0.5) & odd), r + 1.0, r)
    return tl.where(y < 0, -r, r)


@triton.jit
def round_to_bf16(x):
    """fp32 -> the nearest bf16 value (ties to even), still as fp32: finite x only.

    Done on the bits because Triton's interpreter truncates in `.to(tl.bfloat16)`; the
    result is exact in bf16, so any later cast to bf16 keeps it.
    """
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def fp8_bits(y, MANT: tl.constexpr, BIAS: tl.constexpr):
    """fp32 (already within the fp8 range) -> fp8 bits as int32, round to nearest even.

    c10's fp8e4m3fn/fp8e5m2 `from_fp32_value`, for MANT mantissa bits and exponent BIAS.
    """
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    shift: tl.constexpr = 23 - MANT
    # Below the smallest fp8 normal (2**(1 - BIAS)): let an fp32 add round the value
    # onto the subnormal grid, then read the code off the low bits.
    denorm: tl.constexpr = ((127 - BIAS) + shift + 1) << 23
    magic = tl.full(mag.shape, denorm, tl.int32).to(tl.float32, bitcast=True)
    sub = (mag.to(tl.float32, bitcast=True) + magic).to(tl.int32, bitcast=True) - denorm
    # Normal: rebias the exponent and round the mantissa to MANT bits, ties to even.
    odd = (mag >> shift) & 1
    normal = (mag + (((BIAS - 127) << 23) + (1 << (shift - 1)) - 1) + odd) >> shift
    code = tl.where(mag < ((128 - BIAS) << 23), sub, normal)
    return code | sign


@triton.jit
def fp8_to_half(codes, E5M2: tl.constexpr):
    """fp8 bits (uint8) -> fp16 holding the code's value: exact, subnormals included.

    e5m2 is the top byte of an fp16. e4m3 slots into an fp16 as value * 2**-8 (the
    exponent bias differs by 8): the caller multiplies 256 into the scale.
    """
    b = codes.to(tl.int16)
    if E5M2:
        h = b << 8
    else:
        h = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    return h.to(tl.float16, bitcast=True)
