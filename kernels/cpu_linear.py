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

from dataclasses import dataclass

import torch

from . import cpu_packed

MAX_ROWS = 32  # rows per call: two tiles of 16
MULTIPLE = 32  # N and K must be multiples of it
ERRORS = {1: "invalid arguments", 5: "this CPU, kernel or build has no AMX-BF16"}


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

    @property
    def values(self) -> torch.Tensor:
        """The packed values, whichever kernel packed them."""
        return self.tiles

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
        tiles = cpu_packed.pack("kvlab_linear_pack", weight, ERRORS)
        return cls(tiles, n, k)


def cpu_linear(
    x: torch.Tensor, packed: PackedLinear, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x (rows, K) bf16, rows contiguous, rows <= MAX_ROWS -> x W^T + bias (rows, N) bf16."""
    return cpu_packed.run("kvlab_linear_amx", x, packed.tiles, packed.n, packed.k, bias,
                          MAX_ROWS, ERRORS)  # fmt: skip
