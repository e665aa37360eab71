"""A decode step's fp32 linear layers (cpu_stream.c): y = x W^T + b for up to 32 rows,
each weight packed once into the order the kernel streams it.

    PackedStream.pack(weight)        W (N, K) fp32 -> its panels (N a multiple of
                                     stream_width())
    cpu_stream_linear(x, packed, b)  (rows, K) -> (rows, N) fp32, rows <= MAX_ROWS

With a few rows a linear layer takes as long as reading its weights, so the kernel is a
stream: each weight is read once from memory and multiplied by every row, one FMA chain
per output in the order of K. Every output's sum runs in an order fixed by its own row
and column, so the bits do not depend on the thread count or the other rows.

`stream_pays()` says where the runner uses it (kvlab.model.linear.StreamLinears): where
the library is built for AVX-512, whose 32 registers hold a block of 16 rows. On the 2-core
Xeon kvlab is developed on it runs SmolLM2-135M's 121 matmuls of a 16-row step in about
three quarters of oneDNN's time (`kvlab profile --dtype float32` shows both); AVX2 builds
(the AMD EPYC class) keep oneDNN until the kernel is measured there.

This module imports only torch and the standard library.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from . import cpu_packed
from .cpu_build import native_function

MAX_ROWS = 32  # rows per call
ERRORS = {1: "invalid arguments"}


@functools.cache
def stream_width() -> int:
    """Columns per panel: the library's floats per vector (16 with AVX-512, else 8); 0
    without the library."""
    try:
        return int(native_function("kvlab_stream_width", [])())
    except RuntimeError:  # the library is unavailable
        return 0


def stream_pays() -> bool:
    """Whether fp32 steps of up to MAX_ROWS rows run faster through the kernel than through
    oneDNN here, decided from the build: where it is built for AVX-512 (16-float vectors).
    Measured on the Xeon class only, so the AVX2 build keeps oneDNN."""
    return stream_width() == 16


def stream_fits(weight: torch.Tensor) -> bool:
    """Whether the kernel takes this weight: (N, K) fp32 on the CPU, N a multiple of the
    panel width."""
    width = stream_width()
    return (
        width > 0
        and weight.dim() == 2
        and weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and weight.shape[0] % width == 0
    )


@dataclass(frozen=True)
class PackedStream:
    """A weight (N, K) in the kernel's panel order: `panels` holds N * K fp32 values."""

    panels: torch.Tensor  # (N * K,) fp32
    n: int
    k: int

    @classmethod
    def pack(cls, weight: torch.Tensor) -> PackedStream:
        """Pack W (N, K) fp32, its rows contiguous; ValueError if `stream_fits` says no."""
        if not stream_fits(weight) or weight.stride(1) != 1:
            raise ValueError(
                f"the stream linear takes a (N, K) fp32 CPU weight with N a multiple of "
                f"{stream_width()} and contiguous rows; got {tuple(weight.shape)} "
                f"{weight.dtype} on {weight.device}"
            )
        n, k = weight.shape
        panels = cpu_packed.pack("kvlab_stream_pack", weight, ERRORS)
        return cls(panels, n, k)


def cpu_stream_linear(
    x: torch.Tensor, packed: PackedStream, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x (rows, K) fp32, rows contiguous, rows <= MAX_ROWS -> x W^T + bias (rows, N) fp32."""
    return cpu_packed.run("kvlab_stream_linear", x, packed.panels, packed.n, packed.k, bias,
                          MAX_ROWS, ERRORS)  # fmt: skip
