"""A decode step's bf16 linear layers on AMX tiles (cpu_linear.c): y = x W^T + b for up
to 32 rows, each weight packed once into the order the kernel streams it.

    PackedLinear.pack(weight)        W (N, K) bf16 -> its tiles (N and K multiples of 32)
    cpu_linear(x, packed, bias)      (rows, K) -> (rows, N) bf16, rows <= MAX_ROWS

With a few rows a linear layer takes as long as reading its weights, so the kernel is a
stream: each weight is read once, multiplied by every row on the tile unit and summed in
fp32, then rounded to bf16 once. Every output's sum runs in an order fixed by its own row
and column, so the bits do not depend on the thread count or the other rows. Where the CPU
has no AMX-BF16 (`amx_ready` in cpu_prefill.py asks it), nothing here runs.

This module imports only torch and the standard library.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from .cpu_build import native_function, raise_for

MAX_ROWS = 32  # rows per call: two tiles of 16
MULTIPLE = 32  # N and K must be multiples of it
ERRORS = {1: "invalid arguments", 5: "this CPU, kernel or build has no AMX-BF16"}
I64, PTR = ctypes.c_int64, ctypes.c_void_p
PACK = [PTR, I64, I64, I64, PTR]
LINEAR = [PTR, I64, ctypes.c_int, PTR, PTR, PTR, I64, I64, I64, ctypes.c_int]


def linear_fits(weight: torch.Tensor) -> bool:
    """Whether the kernel takes this weight: (N, K) bf16 on the CPU, N and K multiples of 32."""
    return (
        weight.dim() == 2
        and weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and weight.shape[0] % MULTIPLE == 0
        and weight.shape[1] % MULTIPLE == 0
    )


@dataclass(frozen=True)
class PackedLinear:
    """A weight (N, K) in the kernel's tile order: `tiles` holds N * K bf16 values."""

    tiles: torch.Tensor  # (N * K,) bf16
    n: int
    k: int

    @classmethod
    def pack(cls, weight: torch.Tensor) -> PackedLinear:
        """Pack W (N, K) bf16, its rows contiguous; ValueError if `linear_fits` says no."""
        if not linear_fits(weight) or weight.stride(1) != 1:
            raise ValueError(
                f"the AMX linear takes a (N, K) bf16 CPU weight with N and K multiples of "
                f"{MULTIPLE} and contiguous rows; got {tuple(weight.shape)} {weight.dtype} "
                f"on {weight.device}"
            )
        n, k = weight.shape
        tiles = torch.empty(n * k, dtype=torch.bfloat16)
        status = native_function("kvlab_linear_pack", PACK)(
            weight.data_ptr(), weight.stride(0), n, k, tiles.data_ptr()
        )
        raise_for(status, "PackedLinear.pack", ERRORS)
        return cls(tiles, n, k)


def cpu_linear(
    x: torch.Tensor, packed: PackedLinear, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x (rows, K) bf16, rows contiguous, rows <= MAX_ROWS -> x W^T + bias (rows, N) bf16."""
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.stride(1) != 1 or x.device.type != "cpu":
        raise ValueError(f"x must be a (rows, K) bf16 CPU tensor with contiguous rows; got "
                         f"{tuple(x.shape)} {x.dtype} strides {x.stride()}")  # fmt: skip
    rows, k = x.shape
    if k != packed.k or not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"x must be (1..{MAX_ROWS}, {packed.k}); got {tuple(x.shape)}")
    if bias is not None and (bias.shape != (packed.n,) or bias.dtype != torch.bfloat16
                             or not bias.is_contiguous()):  # fmt: skip
        raise ValueError(f"bias must be a contiguous ({packed.n},) bf16 tensor")
    out = torch.empty(rows, packed.n, dtype=torch.bfloat16)
    status = native_function("kvlab_linear_amx", LINEAR)(
        x.data_ptr(), x.stride(0), rows, packed.tiles.data_ptr(),
        None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0), packed.n,
        k, torch.get_num_threads(),
    )  # fmt: skip
    raise_for(status, "cpu_linear", ERRORS)
    return out
