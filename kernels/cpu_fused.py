"""A decoder layer's elementwise parts in bf16 or fp32 on the CPU, one native call each
(cpu_fused.c), for the kernels config's runner:

    cpu_add_rms_norm(h, delta, weight, eps)   h += delta (in place), then the RMS norm of h
    cpu_silu_mul(gate, up)                    SwiGLU's bf16(silu(gate)) * up
    cpu_rope(x, cos, sin)                     RoPE on x's heads

Each rounds to bf16 where torch's bf16 ops do, so the residual add and RoPE give torch's
bits; the norm's sum of squares may differ by one bf16 step in a few elements, SwiGLU (its
e^x and reciprocal) by two. In fp32 nothing is rounded between steps and the results are
torch's to a few ulp. `fused_fits` says which shapes the kernels take: rows of multiples
of 16 (32 per head).

This module imports only torch and the standard library.
"""

from __future__ import annotations

import ctypes

import torch

from .cpu_build import DTYPES, native_function, raise_for

VECTOR = 16  # row lengths must be multiples of it (a head: of two)
ERRORS = {1: "invalid arguments"}
I64, PTR = ctypes.c_int64, ctypes.c_void_p
INT = ctypes.c_int
NORM = [PTR, I64, PTR, I64, PTR, PTR, I64, I64, INT, ctypes.c_float, INT, INT]
SILU = [PTR, I64, PTR, I64, PTR, I64, I64, INT, INT, INT]
ROPE = [PTR, I64, PTR, PTR, I64, PTR, I64, I64, INT, INT, INT, INT]
FUSED_DTYPES = (torch.bfloat16, torch.float32)  # the dtypes the kernels compute in


def fused_fits(hidden: int, intermediate: int, head_dim: int) -> bool:
    """Whether a model of these sizes fits the kernels' vectors."""
    return hidden % VECTOR == 0 and intermediate % VECTOR == 0 and head_dim % (2 * VECTOR) == 0


def _rows(t: torch.Tensor, name: str) -> None:
    """t must be (rows, n) bf16 or fp32 on the CPU with its last dim contiguous."""
    if t.dtype not in FUSED_DTYPES or t.device.type != "cpu" or t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(
            f"{name} must be a (rows, n) bf16 or fp32 CPU tensor with contiguous rows; got "
            f"{tuple(t.shape)} {t.dtype} strides {t.stride()} on {t.device}"
        )
    if t.shape[1] % VECTOR:
        raise ValueError(f"{name}'s rows must be a multiple of {VECTOR} long; got {t.shape[1]}")


def _same_dtype(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dtype != b.dtype:
        raise ValueError(f"the tensors must share one dtype; got {a.dtype} and {b.dtype}")


def cpu_add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """h += delta (when given, in place), then weight * round(h * rsqrt(mean(h^2) + eps)),
    rounded to bf16 where h is bf16.

    h, delta: (T, hidden); weight: (hidden,); all bf16 or all fp32 -> (T, hidden).
    """
    _rows(h, "h")
    if delta is not None:
        _rows(delta, "delta")
        _same_dtype(h, delta)
    if weight.shape != (h.shape[1],) or weight.dtype != h.dtype or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous ({h.shape[1]},) {h.dtype} tensor")
    out = torch.empty(h.shape, dtype=h.dtype)
    status = native_function("kvlab_add_rms_norm", NORM)(
        h.data_ptr(), h.stride(0),
        None if delta is None else delta.data_ptr(), 0 if delta is None else delta.stride(0),
        weight.data_ptr(), out.data_ptr(), out.stride(0), h.shape[0], h.shape[1], float(eps),
        torch.get_num_threads(), DTYPES[h.dtype],
    )  # fmt: skip
    raise_for(status, "cpu_add_rms_norm", ERRORS)
    return out


def cpu_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """round(silu(gate)) * up: gate, up (T, inter) bf16 or fp32, rows contiguous ->
    (T, inter)."""
    _rows(gate, "gate")
    _rows(up, "up")
    _same_dtype(gate, up)
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have one shape; got {gate.shape}, {up.shape}")
    out = torch.empty(gate.shape, dtype=gate.dtype)
    status = native_function("kvlab_silu_mul", SILU)(
        gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0), out.data_ptr(),
        out.stride(0), gate.shape[0], gate.shape[1], torch.get_num_threads(), DTYPES[gate.dtype],
    )  # fmt: skip
    raise_for(status, "cpu_silu_mul", ERRORS)
    return out


def cpu_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, as kvlab.model.runner.apply_rope rounds it.

    x: (T, heads, head_dim) bf16 or fp32, each row's heads side by side (a view into a fused
    QKV output works); cos, sin: (T, head_dim) of x's dtype with one row stride -> a new
    contiguous (T, heads, head_dim) tensor.
    """
    if x.dim() != 3 or x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        raise ValueError(f"x must be (T, heads, head_dim), its heads side by side; got "
                         f"{tuple(x.shape)} strides {x.stride()}")  # fmt: skip
    rows, heads, head_dim = x.shape
    _rows(x[:, 0, :], "x")
    _rows(cos, "cos")
    _rows(sin, "sin")
    _same_dtype(x, cos)
    _same_dtype(x, sin)
    if cos.shape != (rows, head_dim) or sin.shape != cos.shape or sin.stride() != cos.stride():
        raise ValueError(f"cos and sin must be ({rows}, {head_dim}) with one stride")
    if head_dim % (2 * VECTOR):
        raise ValueError(f"head_dim must be a multiple of {2 * VECTOR}; got {head_dim}")
    out = torch.empty(x.shape, dtype=x.dtype)
    status = native_function("kvlab_rope", ROPE)(
        x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), cos.stride(0),
        out.data_ptr(), out.stride(0), rows, heads, head_dim, torch.get_num_threads(),
        DTYPES[x.dtype],
    )  # fmt: skip
    raise_for(status, "cpu_rope", ERRORS)
    return out
