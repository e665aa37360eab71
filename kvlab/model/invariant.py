"""Batch-invariant mode: a request's logits, bit for bit, whatever else the step holds.

    Engine(model, EngineConfig(batch_invariant=True))
    ModelRunner(hf_model, InvariantAttention(), batch_invariant=True)  # a runner alone

In fp32 a sum's rounding depends on the order of its terms. A library kernel picks its
blocking by the shape of the whole batch (how many rows, how long the longest context)
and by the CPU it runs on (oneDNN and MKL take other code paths with AVX-512 or AMX than
with AVX2), so one row's terms are summed in another order when the batch changes, and
at a near-tie the greedy token flips. Batch-invariant mode builds every reduction and
every transcendental function of a step from kvlab's own code, whose order is written
down and depends on the row alone (kvlab.kernels.cpu_invariant), on any CPU:

* **Linears** (QKV, O, MLP, LM head): `invariant_linear`, each output a dot product in
  16 lanes and a fixed tree, whole on one thread.
* **RMSNorm**: the sum of squares through the same dot product (against a row of ones).
* **SwiGLU**: silu(g) = g / (1 + e^-g) with kvlab's e^x, the same code for every element
  (torch's vectorised loops compute a tensor's tail elements with another function).
* **RoPE**: cos and sin per position from a table that each position enters once,
  computed one value at a time in float64 (math.cos), so a position's row never depends
  on which positions came with it.
* **Attention**: kvlab.model.invariant_attention, in torch over the same dot products
  and e^x, or (attention="kernels" on the CPU) the native prompt kernel for every row,
  decodes included.
* Residual adds, products, divisions and square roots are single IEEE operations: the
  same bits in any order of rows.

It needs no other change to the engine: the scheduler may batch, chunk and share
prefixes as it likes. It needs kvlab's native CPU kernels (a C compiler) and the CPU.
"""

from __future__ import annotations

import math

import torch

from kvlab.model.invariant_attention import invariant_attention, invariant_cpu_attention


def _kernels():
    from kvlab.kernels import cpu_invariant

    return cpu_invariant


class InvariantLinears:
    """y = x @ weight.T + bias through kvlab's fixed-order dot products."""

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x: (T, in), weight: (out, in), bias: (out,) or None -> (T, out) in x's dtype."""
        out = _kernels().invariant_linear(x, weight)  # (T, out) fp32
        if bias is not None:
            out += bias.float()
        return out.to(x.dtype)


def invariant_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """kvlab.model.runner.rms_norm with the sum of squares in the fixed order."""
    x32 = x.float()
    ones = torch.ones(1, x.shape[-1])
    squares = _kernels().invariant_linear(x32 * x32, ones)  # (T, 1): sum of x^2 per row
    x32 = x32 / torch.sqrt(squares / x.shape[-1] + eps)  # IEEE ops: any order
    return weight * x32.to(x.dtype)


def invariant_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, silu = g / (1 + e^-g) with kvlab's e^x, rounded to gate's dtype as
    F.silu rounds."""
    g = gate.float()
    silu = g / (1.0 + _kernels().invariant_exp(-g))
    return silu.to(gate.dtype).mul_(up)


class InvariantRope:
    """cos, sin for positions, (T, head_dim) each, from a table grown a position at a time:
    position p's values are computed once, in float64 from its float32 angles, whatever
    else is asked with it."""

    def __init__(self, inv_freq: torch.Tensor, scale: float, dtype: torch.dtype):
        self.inv_freq, self.scale, self.dtype = inv_freq.float(), scale, dtype
        self.cos = torch.empty(0, 2 * inv_freq.numel(), dtype=dtype)
        self.sin = torch.empty_like(self.cos)

    def _grow(self, size: int) -> None:
        new = torch.arange(self.cos.shape[0], size, dtype=torch.float32)
        angles = (new[:, None] * self.inv_freq[None, :]).tolist()  # fp32 products, exact
        cos = [[math.cos(a) * self.scale for a in row] * 2 for row in angles]
        sin = [[math.sin(a) * self.scale for a in row] * 2 for row in angles]
        cos_t = torch.tensor(cos, dtype=torch.float64).float().to(self.dtype)
        sin_t = torch.tensor(sin, dtype=torch.float64).float().to(self.dtype)
        self.cos, self.sin = torch.cat([self.cos, cos_t]), torch.cat([self.sin, sin_t])

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top = int(positions.max()) + 1 if positions.numel() else 0
        if top > self.cos.shape[0]:
            self._grow(max(top, 2 * self.cos.shape[0], 256))
        positions = positions.cpu()
        return self.cos[positions], self.sin[positions]


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
    `kernels` is set, else invariant_attention (torch over kvlab's dot products)."""

    def __init__(self, kernels: bool = False):
        self.kernels = kernels

    def __call__(self, q, layer, pool, meta, scale) -> torch.Tensor:
        if self.kernels and kernel_runs(pool.kv_codec, q.shape[-1], q.device):
            return invariant_cpu_attention(q, layer, pool, meta, scale)
        return invariant_attention(q, layer, pool, meta, scale)


def check_invariant_runs(device: torch.device) -> None:
    """ValueError unless batch-invariant mode can run here: the CPU, the native kernels."""
    if device.type != "cpu":
        raise ValueError(
            f"EngineConfig.batch_invariant=True runs on the CPU; the model is on "
            f"{device.type} (its GPU kernels choose splits by batch)"
        )
    from kvlab.kernels import cpu_kernels_available
    from kvlab.kernels.cpu_build import cpu_kernels_error

    if not cpu_kernels_available():
        raise ValueError(
            "EngineConfig.batch_invariant=True sums with kvlab's native CPU kernels, which "
            f"are unavailable here: {cpu_kernels_error()}"
        )


__all__ = [
    "InvariantAttention",
    "InvariantLinears",
    "InvariantRope",
    "check_invariant_runs",
    "invariant_rms_norm",
    "invariant_silu_mul",
    "kernel_runs",
]
