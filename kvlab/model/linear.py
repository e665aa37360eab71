"""The runner's matrix multiplies: on the CPU through oneDNN, each weight reordered once.

vLLM's CPU backend hands every linear layer to oneDNN with its weight reordered once, at
load time, into the blocked layout oneDNN reads fastest for a batch of about 32 rows
(`create_onednn_mm(weight.t(), 32)`). torch reaches the same library through the ops its
compiler uses on the CPU (`mkldnn._reorder_linear_weight`, `mkldnn._linear_pointwise`):
`Linears` reorders the runner's weights that way and multiplies through them. On the
2-core CPU kvlab is developed on, the linears of SmolLM2-135M for 16 decoding sequences
take about 42 ms reordered against 75-90 ms through `F.linear` (`kvlab profile` shows a
step's parts). The reordered copies cost one more copy of the weights in memory; the
dense ones stay (tensor parallelism slices them, the decode floor counts them).
Elsewhere (CUDA, fp16, a torch without these ops) it is plain `F.linear`.

A decode step's few rows make a linear layer a stream of its weights. `AmxLinears` runs
bf16 steps of up to 32 rows through kvlab's own AMX kernel (kvlab.kernels.cpu_linear),
which streams each weight from a copy packed once in the order it reads it: on the 2-core
Xeon kvlab is developed on, SmolLM2-135M's 121 matmuls of a 16-row step take about 12.5 ms
(21.5 GB/s of weights) against oneDNN's 16-20 ms. Larger steps (prompts) stay on oneDNN.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

BATCH_HINT = 32  # rows the reordered layout is tuned for (vLLM's choice); any count works


def reorders(weight: torch.Tensor) -> bool:
    """Whether `weight` is multiplied through oneDNN: on the CPU, fp32 or (where the CPU
    has bf16 instructions) bf16, when torch has the ops."""
    ops = torch.ops.mkldnn
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
        return False
    if weight.dtype == torch.bfloat16:
        return ops._is_mkldnn_bf16_supported()
    return weight.dtype == torch.float32


class Linears:
    """y = x @ weight.T + bias for the weights given at construction, each reordered
    once; any other weight goes through F.linear."""

    def __init__(self, weights: Iterable[torch.Tensor]):
        self.reordered: dict[int, torch.Tensor] = {}  # dense data_ptr -> oneDNN copy
        self._dense: list[torch.Tensor] = []  # keeps each key's tensor alive
        for weight in weights:
            if reorders(weight) and weight.data_ptr() not in self.reordered:
                ordered = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)
                self.reordered[weight.data_ptr()] = ordered
                self._dense.append(weight)

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x: (T, in), weight: (out, in), bias: (out,) or None -> (T, out)."""
        ordered = self.reordered.get(weight.data_ptr())
        if ordered is None or x.dtype != weight.dtype:
            return F.linear(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, ordered, bias, "none", [], "")


class AmxLinears:
    """bf16 steps of up to 32 rows on AMX tiles (kvlab.kernels.cpu_linear), each weight the
    kernel takes packed once; larger steps and any other weight through `linears`."""

    def __init__(self, linears: Linears, weights: Iterable[torch.Tensor]):
        from kvlab.kernels.cpu_linear import PackedLinear, linear_fits

        self.linears = linears
        self.packed = {}  # dense data_ptr -> PackedLinear
        self._dense: list[torch.Tensor] = []  # keeps each key's tensor alive
        for weight in weights:
            if linear_fits(weight) and weight.data_ptr() not in self.packed:
                self.packed[weight.data_ptr()] = PackedLinear.pack(weight.detach())
                self._dense.append(weight)

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x: (T, in), weight: (out, in), bias: (out,) or None -> (T, out)."""
        from kvlab.kernels.cpu_linear import MAX_ROWS, cpu_linear

        packed = self.packed.get(weight.data_ptr())
        if packed is None or x.shape[0] > MAX_ROWS or x.dtype != torch.bfloat16:
            return self.linears(x, weight, bias)
        return cpu_linear(x if x.stride(-1) == 1 else x.contiguous(), packed, bias)
