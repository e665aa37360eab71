"""Batch-invariant mode: a request's logits, bit for bit, whatever else the step holds.

    Engine(model, EngineConfig(batch_invariant=True))
    ModelRunner(hf_model, InvariantAttention(), batch_invariant=True)  # a runner alone

In fp32 a sum's rounding depends on the order of its terms. A kernel that picks its
blocking by the shape of the whole batch (how many rows, how long the longest context)
sums one row's terms in another order when the batch changes, and at a near-tie the
greedy token flips. A step of kvlab computes each row through a chain of reductions;
batch-invariant mode makes every one of them sum in an order fixed by the row alone:

* **Linears** (QKV, O, MLP, LM head): oneDNN's matmul over the weights kvlab reorders
  once (kvlab.model.linear) accumulates each output over the input dimension in one
  order for any row count and thread count (measured: kvlab.experiments.determinism,
  tests/test_batch_invariant.py). Where a weight is not reordered (F.linear, MKL), the
  rows are padded to a multiple of ROW_TILE, which keeps MKL's sgemm on one code path.
* **RMSNorm, RoPE, SwiGLU**: per-row reductions and elementwise ops; they already are.
* **Attention**: kvlab.model.invariant_attention, in torch or (attention="kernels" on
  the CPU) through the native prompt kernel for every row, decodes included.

It needs no other change to the engine: the scheduler may batch, chunk and share
prefixes as it likes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvlab.model.invariant_attention import (
    ROW_TILE,
    invariant_attention,
    invariant_cpu_attention,
    padded,
)
from kvlab.model.linear import Linears


class PaddedLinears:
    """`Linears`, with F.linear's inputs padded to a multiple of ROW_TILE rows."""

    def __init__(self, linears: Linears):
        self.linears = linears

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x: (T, in), weight: (out, in), bias: (out,) or None -> (T, out)."""
        ordered = self.linears.reordered.get(weight.data_ptr())
        if ordered is not None and x.dtype == weight.dtype:
            return self.linears(x, weight, bias)
        rows = x.shape[0]
        return F.linear(F.pad(x, (0, 0, 0, padded(rows) - rows)), weight, bias)[:rows]


def kernel_runs(pool_codec: str | None, head_dim: int, device: torch.device) -> bool:
    """Whether invariant_cpu_attention can run: CPU tensors, float K/V, the native
    kernels built, head_dim a multiple of 16."""
    from kvlab.kernels import cpu_kernels_available
    from kvlab.kernels.cpu_prefill import prefill_fits
    from kvlab.kernels.dispatch import CPU_CODECS

    return (
        device.type == "cpu"
        and pool_codec in CPU_CODECS
        and prefill_fits(head_dim)
        and cpu_kernels_available()
    )


class InvariantAttention:
    """An attention_fn for ModelRunner: invariant_cpu_attention where it runs and
    `kernels` is set, else invariant_attention (torch)."""

    def __init__(self, kernels: bool = False):
        self.kernels = kernels

    def __call__(self, q, layer, pool, meta, scale) -> torch.Tensor:
        if self.kernels and kernel_runs(pool.kv_codec, q.shape[-1], q.device):
            return invariant_cpu_attention(q, layer, pool, meta, scale)
        return invariant_attention(q, layer, pool, meta, scale)


def invariant_linears(linear: Linears, device: torch.device) -> PaddedLinears:
    """A runner's matmuls in batch-invariant mode (ModelRunner(..., batch_invariant=True));
    ValueError off the CPU."""
    if device.type != "cpu":
        raise ValueError(
            f"EngineConfig.batch_invariant=True runs on the CPU; the model is on "
            f"{device.type} (its GPU kernels choose splits by batch)"
        )
    return PaddedLinears(linear)


__all__ = ["ROW_TILE", "InvariantAttention", "PaddedLinears", "invariant_linears"]
