"""Batch-invariant matmuls and e^x on the CPU: native C (cpu_invariant.c), through ctypes.

    out = invariant_bmm(x, w)     # x (B, M, K), w (B, N, K) -> (B, M, N) fp32
    out = invariant_linear(x, w)  # x (T, K), w (N, K) -> (T, N) fp32: x @ w.T
    out = invariant_exp(x)        # e^x elementwise, fp32; e^-inf = 0

Each output's sum runs in one order fixed by its reduction index alone (16 lanes, lane j
taking every 16th term, then a fixed pairwise tree), whatever the other rows, the thread
count or the CPU's vector width; contraction into FMA is off, so every product and sum
rounds on its own. A row's output is therefore the same bits alone, in a batch of any
size, and (where its extra terms are exact zeros) inside a longer product. This is what
batch-invariant mode (kvlab.model.invariant) builds every reduction from, instead of
oneDNN's and MKL's matmuls, whose blocking they choose by shape and by CPU.

x and w: float32 or bfloat16, last dim contiguous. No autograd.
This module imports only torch and the standard library.
"""

from __future__ import annotations

import ctypes

import torch

from .cpu_build import DTYPES, native_function, raise_for

BMM_SIGNATURE = (
    [ctypes.c_void_p] * 3  # x, w, out
    + [ctypes.c_int] * 2  # dtype_x, dtype_w
    + [ctypes.c_int64] * 8  # batch, M, N, K, x batch/row strides, w batch/row strides
    + [ctypes.c_int]  # num_threads
)
EXP_SIGNATURE = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
DTYPES_TAKEN = (torch.float32, torch.bfloat16)


def _operand(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.device.type != "cpu" or t.dtype not in DTYPES_TAKEN:
        raise ValueError(f"{name} must be a CPU float32 or bfloat16 tensor; got {t.dtype}")
    t = t.detach()
    return t if t.stride(-1) == 1 and t.stride(-2) >= t.shape[-1] else t.contiguous()


def invariant_bmm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (B, M, K), w (B, N, K) -> (B, M, N) float32: out[b, m, n] = x[b, m] . w[b, n],
    each dot product in the fixed order of the module docstring. B of w may be 1
    (broadcast over x's batch)."""
    shapes_fit = x.dim() == w.dim() == 3 and x.shape[2] == w.shape[2]
    if not shapes_fit or w.shape[0] not in (1, x.shape[0]):
        raise ValueError(
            f"invariant_bmm takes x (B, M, K) and w (B or 1, N, K); got {tuple(x.shape)} "
            f"and {tuple(w.shape)}"
        )
    x, w = _operand(x, "x"), _operand(w, "w")
    batch, rows, depth = x.shape
    cols = w.shape[1]
    out = torch.empty(batch, rows, cols, dtype=torch.float32)
    if out.numel() == 0:
        return out
    if depth == 0:
        return out.zero_()
    kernel = native_function("kvlab_invariant_bmm", BMM_SIGNATURE, x.dtype, w.dtype)
    status = kernel(
        x.data_ptr(), w.data_ptr(), out.data_ptr(), DTYPES[x.dtype], DTYPES[w.dtype],
        batch, rows, cols, depth, x.stride(0), x.stride(1),
        w.stride(0) if w.shape[0] > 1 else 0, w.stride(1), torch.get_num_threads(),
    )  # fmt: skip
    raise_for(status, "kvlab_invariant_bmm", {1: "invalid arguments"})
    return out


def invariant_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (T, K), weight (N, K) -> (T, N) float32: x @ weight.T, batch-invariant."""
    return invariant_bmm(x[None], weight[None])[0]


def invariant_exp(x: torch.Tensor) -> torch.Tensor:
    """e^x of a float32 CPU tensor, every element through the same code (0 for -inf)."""
    if x.device.type != "cpu" or x.dtype != torch.float32:
        raise ValueError(f"invariant_exp takes a CPU float32 tensor; got {x.dtype}")
    x = x.detach().contiguous()
    out = torch.empty_like(x)
    if x.numel():
        kernel = native_function("kvlab_invariant_exp", EXP_SIGNATURE)
        raise_for(kernel(x.data_ptr(), out.data_ptr(), x.numel()), "kvlab_invariant_exp", {})
    return out
