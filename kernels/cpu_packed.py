"""What the packed-weight linears share (cpu_linear.py: bf16 on AMX tiles; cpu_stream.py:
fp32 through the FMAs): packing a weight once, and one call of the kernel on up to
`max_rows` rows, each input checked before the native code reads it.

This module imports only torch and the standard library.
"""

from __future__ import annotations

import ctypes

import torch

from .cpu_build import native_function, raise_for

I64, PTR = ctypes.c_int64, ctypes.c_void_p
PACK = [PTR, I64, I64, I64, PTR]  # w, w_stride, n, k, packed
LINEAR = [PTR, I64, ctypes.c_int, PTR, PTR, PTR, I64, I64, I64, ctypes.c_int]
NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32"}


def pack(entry: str, weight: torch.Tensor, errors: dict[int, str]) -> torch.Tensor:
    """W (N, K), rows contiguous -> its N * K values in the order `entry` packs them."""
    n, k = weight.shape
    packed = torch.empty(n * k, dtype=weight.dtype)
    status = native_function(entry, PACK)(
        weight.data_ptr(), weight.stride(0), n, k, packed.data_ptr()
    )
    raise_for(status, entry, errors)
    return packed


def run(
    entry: str,
    x: torch.Tensor,
    packed: torch.Tensor,
    n: int,
    k: int,
    bias: torch.Tensor | None,
    max_rows: int,
    errors: dict[int, str],
) -> torch.Tensor:
    """x (rows, K) in the packed weight's dtype, rows contiguous, rows <= max_rows ->
    x W^T + bias (rows, N) through the native `entry`."""
    dtype = packed.dtype
    name = NAMES[dtype]
    if x.dtype != dtype or x.dim() != 2 or x.stride(1) != 1 or x.device.type != "cpu":
        raise ValueError(f"x must be a (rows, K) {name} CPU tensor with contiguous rows; got "
                         f"{tuple(x.shape)} {x.dtype} strides {x.stride()}")  # fmt: skip
    rows = x.shape[0]
    if x.shape[1] != k or not 1 <= rows <= max_rows:
        raise ValueError(f"x must be (1..{max_rows}, {k}); got {tuple(x.shape)}")
    if bias is not None and (bias.shape != (n,) or bias.dtype != dtype or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous ({n},) {name} tensor")
    out = torch.empty(rows, n, dtype=dtype)
    status = native_function(entry, LINEAR)(
        x.data_ptr(), x.stride(0), rows, packed.data_ptr(),
        None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0), n, k,
        torch.get_num_threads(),
    )  # fmt: skip
    raise_for(status, entry, errors)
    return out
