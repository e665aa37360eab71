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
`StreamLinears` does the same for fp32 steps, and for bf16 steps where the CPU has no AMX,
through kvlab's vector stream (kvlab.kernels.cpu_stream) where the library is built with
FMA vectors, AVX-512 or AVX2 (bf16: AVX512-BF16). Both are `PackedLinears`: a kernel,
the weights it takes packed once, the rest left to `linears`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

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


class PackedLinears:
    """Steps of up to `max_rows` rows in `dtype` through one of kvlab's native kernels that
    stream a packed weight (a subclass's `kernel` names it), each weight it takes packed
    once; larger steps and any other weight through `linears`."""

    dtype: torch.dtype
    max_rows: int

    @staticmethod
    def kernel() -> tuple[Callable, Callable, Callable]:
        """The kernel's fits(weight) -> bool, pack(weight) -> packed and
        run(x, packed, bias) -> (rows, out), imported when first asked for."""
        raise NotImplementedError

    def __init__(self, linears: Linears, weights: Iterable[torch.Tensor]):
        self.linears = linears
        fits, pack, self.run = self.kernel()
        self.packed = {}  # dense data_ptr -> the kernel's packed copy
        self._dense: list[torch.Tensor] = []  # keeps each key's tensor alive
        for weight in weights:
            if fits(weight) and weight.data_ptr() not in self.packed:
                self.packed[weight.data_ptr()] = pack(weight.detach())
                self._dense.append(weight)

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x: (T, in), weight: (out, in), bias: (out,) or None -> (T, out)."""
        packed = self.packed.get(weight.data_ptr())
        if packed is None or x.shape[0] > self.max_rows or x.dtype != self.dtype:
            return self.linears(x, weight, bias)
        return self.run(x if x.stride(-1) == 1 else x.contiguous(), packed, bias)


class AmxLinears(PackedLinears):
    """bf16 steps of up to 32 rows on AMX tiles (kvlab.kernels.cpu_linear)."""

    dtype, max_rows = torch.bfloat16, 32

    @staticmethod
    def kernel():
        from kvlab.kernels import cpu_linear

        return cpu_linear.linear_fits, cpu_linear.PackedLinear.pack, cpu_linear.cpu_linear


class StreamLinears(PackedLinears):
    """fp32 or bf16 steps of up to 32 rows through kvlab's vector stream
    (kvlab.kernels.cpu_stream)."""

    max_rows = 32

    def __init__(
        self, linears: Linears, weights: Iterable[torch.Tensor], dtype: torch.dtype = torch.float32
    ):
        """The weights of `dtype` packed; any other weight is left to `linears`."""
        self.dtype = dtype
        weights = [w for w in weights if w.dtype == dtype]
        super().__init__(linears, weights)

    @staticmethod
    def kernel():
        from kvlab.kernels import cpu_stream

        return cpu_stream.stream_fits, cpu_stream.PackedStream.pack, cpu_stream.cpu_stream_linear
