"""A decode step's linear layers streamed (cpu_stream.c): y = x W^T + b for up to 32 rows,
in fp32, or in bf16 where the build has AVX512-BF16, each weight packed once into the
order the kernel streams it.

    PackedStream.pack(weight)        W (N, K) fp32 or bf16 -> its panels (N a multiple of
                                     stream_width(dtype); bf16: K even)
    cpu_stream_linear(x, packed, b)  (rows, K) -> (rows, N) in W's dtype, rows <= MAX_ROWS

With a few rows a linear layer takes as long as reading its weights, so the kernel is a
stream: each weight is read once from memory and multiplied by every row, one fp32 chain
per output in the order of K (an FMA per value in fp32, a vdpbf16ps per pair in bf16,
rounded to bf16 once at the end). Every output's sum runs in an order fixed by its own
row and column, so the bits do not depend on the thread count or the other rows.

`stream_pays(dtype)` says where the runner uses it (kvlab.model.linear.StreamLinears):
wherever the library is built for it (fp32: FMA vectors, AVX-512 or AVX2; bf16:
AVX512-BF16; the runner prefers the AMX linears where the CPU has AMX). On the 2-core
Xeon kvlab is developed on it runs SmolLM2-135M's 121 fp32 matmuls of a 16-row step in
about 0.7 of oneDNN's time, on the 2-core AMD EPYC with AVX-512 and AVX512-BF16 (no AMX)
its bf16 ones in about 0.7 of oneDNN's time, and on the 2-core AMD EPYC with AVX2 its fp32
ones in about two thirds (`kvlab profile` shows both; the EPYCs measured before a block
walked several panels side by side).

This module imports only torch and the standard library.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from . import cpu_packed
from .cpu_build import DTYPES, native_function

MAX_ROWS = 32  # rows per call
ERRORS = {1: "invalid arguments", 5: "this build has no AVX512-BF16"}
ENTRIES = {  # dtype -> (pack, linear)
    torch.float32: ("kvlab_stream_pack", "kvlab_stream_linear"),
    torch.bfloat16: ("kvlab_stream_pack_bf16", "kvlab_stream_linear_bf16"),
}


@functools.cache
def stream_width(dtype: torch.dtype = torch.float32) -> int:
    """Columns per panel of the kernel for `dtype`: fp32, the library's floats per vector
    (16 with AVX-512, 8 with AVX2) where the build has FMA instructions; bf16, 16 where it
    has AVX512-BF16; 0 where there is no such kernel or no library."""
    if dtype not in DTYPES:
        return 0
    try:
        return int(native_function("kvlab_stream_width", [ctypes.c_int])(DTYPES[dtype]))
    except RuntimeError:  # the library is unavailable
        return 0


def stream_pays(dtype: torch.dtype = torch.float32) -> bool:
    """Whether steps of up to MAX_ROWS rows in `dtype` run faster through the kernel than
    through oneDNN here, decided from the build: wherever the kernel is built for `dtype`
    (fp32: FMA vectors, AVX-512 or AVX2; bf16: AVX512-BF16). Measured in fp32 on the Xeon,
    the AMD EPYC with AVX-512 and the AMD EPYC with AVX2 (there SmolLM2-135M's 121 matmuls
    of a step took 31-35 ms against oneDNN's 42-48 for 1 row, 49-55 against 76-82 for 16,
    73-91 against 100-106 for 32, one panel at a time), in bf16 on the EPYC with
    AVX512-BF16."""
    return stream_width(torch.float32) > 0 and stream_width(dtype) > 0


def stream_fits(weight: torch.Tensor) -> bool:
    """Whether the kernel takes this weight: (N, K) fp32 or bf16 on the CPU, N a multiple
    of the panel width (bf16: K even) and a kernel built for its dtype."""
    width = stream_width(weight.dtype) if weight.dtype in ENTRIES else 0
    return (
        width > 0
        and weight.dim() == 2
        and weight.device.type == "cpu"
        and weight.shape[0] % width == 0
        and (weight.dtype == torch.float32 or weight.shape[1] % 2 == 0)
    )


@dataclass(frozen=True)
class PackedStream:
    """A weight (N, K) in the kernel's panel order: `panels` holds its N * K values."""

    panels: torch.Tensor  # (N * K,) fp32 or bf16
    n: int
    k: int

    @property
    def values(self) -> torch.Tensor:
        """The packed values, whichever kernel packed them."""
        return self.panels

    @classmethod
    def pack(cls, weight: torch.Tensor) -> PackedStream:
        """Pack W (N, K) fp32 or bf16, its rows contiguous; ValueError if `stream_fits`
        says no."""
        if not stream_fits(weight) or weight.stride(1) != 1:
            has = {dt: "yes" if stream_width(dt) else "no" for dt in ENTRIES}
            raise ValueError(
                f"the stream linear takes a (N, K) fp32 CPU weight with N a multiple of "
                f"{stream_width()} where the build has FMA instructions ({has[torch.float32]} "
                f"here), or bf16 with N a multiple of 16 and K even where the build has "
                f"AVX512-BF16 ({has[torch.bfloat16]} here), with contiguous rows; got "
                f"{tuple(weight.shape)} {weight.dtype} on {weight.device}"
            )
        n, k = weight.shape
        panels = cpu_packed.pack(ENTRIES[weight.dtype][0], weight, ERRORS)
        return cls(panels, n, k)


def cpu_stream_linear(
    x: torch.Tensor, packed: PackedStream, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x (rows, K) in the weight's dtype, rows contiguous, rows <= MAX_ROWS -> x W^T + bias
    (rows, N) in that dtype."""
    entry = ENTRIES[packed.panels.dtype][1]
    return cpu_packed.run(entry, x, packed.panels, packed.n, packed.k, bias, MAX_ROWS, ERRORS)
