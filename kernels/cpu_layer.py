"""A decoder layer's decode step around attention in two native calls (cpu_layer.c), in
bf16 or fp32:

    LayerKernels.qkv(i, h, delta, cos, sin)   h += delta; norm; QKV matmul; RoPE on Q and K
    LayerKernels.mlp(i, h, attn)              O matmul; h += o; norm; gate/up; SwiGLU; down

For a decode step's few rows each of a layer's ten small native calls costs more in Python
(its wrapper, the ctypes call, a new tensor) than in the kernel; these two run the same
entry points in the same order inside the library (cpu_fused.c's elementwise kernels,
cpu_linear.c's AMX matmuls in bf16 or cpu_stream.c's stream in fp32 or bf16), so they give
the per-op path's bits. Up to MAX_ROWS rows, where the runner's matmuls are those kernels'
(AMX-BF16 or the stream for bf16, the stream for fp32); the runner takes the per-op path
elsewhere.
`matmul_seconds()` is the wall time these calls spent in their matmuls, ever.

This module imports only torch and the standard library.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .cpu_build import DTYPES, native_function, raise_for
from .cpu_fused import FUSED_DTYPES, fused_fits
from .cpu_linear import MAX_ROWS, PackedLinear
from .cpu_stream import PackedStream

ERRORS = {1: "invalid arguments", 4: "out of memory", 5: "this CPU or build has no AMX-BF16 "
          "(AVX512-BF16 for the bf16 stream)"}  # fmt: skip
I64, PTR, INT, FLOAT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
QKV = [PTR, PTR, PTR, FLOAT, PTR, PTR, PTR, PTR, I64, PTR, INT, INT, INT, INT, INT, INT, INT, INT]
MLP = [PTR, PTR, I64, PTR, PTR, FLOAT, PTR, PTR, PTR, INT, INT, INT, INT, INT, INT, INT]
Packed = PackedLinear | PackedStream  # bf16 on AMX tiles, fp32 or bf16 through the stream


@dataclass(frozen=True)
class PackedLayer:
    """One layer's weights as the calls take them: norms (hidden,) in the model's dtype,
    matmuls packed in it (for the AMX linear, bf16 only, or the stream)."""

    input_norm: torch.Tensor
    qkv: Packed  # ((heads + 2 kv_heads) * head_dim, hidden)
    qkv_bias: torch.Tensor | None  # (N,) or None
    o: Packed  # (hidden, heads * head_dim)
    post_norm: torch.Tensor
    gate_up: Packed  # (2 * inter, hidden)
    down: Packed  # (hidden, inter)


class LayerKernels:
    """Each layer's decode step around attention, two native calls a layer."""

    def __init__(
        self, layers: Sequence[PackedLayer], heads: int, kv_heads: int, head_dim: int, eps: float
    ):
        """ValueError unless every layer's shapes agree with the heads and fit the kernels,
        its norms and matmuls share one dtype and its matmuls one kernel."""
        hidden, inter = layers[0].o.n, layers[0].down.k
        dtype, kind = layers[0].input_norm.dtype, type(layers[0].qkv)
        q_dim, n = heads * head_dim, (heads + 2 * kv_heads) * head_dim
        if not fused_fits(hidden, inter, head_dim):
            raise ValueError(f"hidden {hidden}, intermediate {inter}, head_dim {head_dim} do "
                             "not fit the fused kernels")  # fmt: skip
        for i, w in enumerate(layers):
            shapes = [(x.n, x.k) for x in (w.qkv, w.o, w.gate_up, w.down)]
            if shapes != [(n, hidden), (hidden, q_dim), (2 * inter, hidden), (hidden, inter)]:
                raise ValueError(f"layer {i}'s matmuls {shapes} do not fit {heads} heads, "
                                 f"{kv_heads} KV heads of {head_dim}, hidden {hidden}")  # fmt: skip
            for norm in (w.input_norm, w.post_norm):
                if norm.shape != (hidden,) or norm.dtype != dtype or dtype not in FUSED_DTYPES:
                    raise ValueError(f"layer {i}'s norms must be ({hidden},), bf16 or fp32")
            mats = (w.qkv, w.o, w.gate_up, w.down)
            if not all(type(x) is kind and x.values.dtype == dtype for x in mats):
                raise ValueError(f"layer {i}'s matmuls must be {dtype}, all packed as "
                                 f"{kind.__name__} (the first layer's QKV)")  # fmt: skip
        self.layers = list(layers)
        self.hidden, self.inter, self.q_dim, self.n = hidden, inter, q_dim, n
        self.kv_dim = kv_heads * head_dim
        self.heads, self.kv_heads, self.head_dim, self.eps = heads, kv_heads, head_dim, eps
        self.dtype, self.stream = dtype, int(kind is PackedStream)
        self._qkv = native_function("kvlab_layer_qkv", QKV)
        self._mlp = native_function("kvlab_layer_mlp", MLP)

    def takes(self, h: torch.Tensor) -> bool:
        """Whether the calls take this residual stream: (1..MAX_ROWS, hidden) in the
        layers' dtype on the CPU, contiguous (the runner's own)."""
        return (
            h.dtype == self.dtype
            and h.device.type == "cpu"
            and h.is_contiguous()
            and 1 <= h.shape[0] <= MAX_ROWS
            and h.shape[1] == self.hidden
        )

    def qkv(
        self,
        index: int,
        h: torch.Tensor,
        delta: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h += delta (in place, when given); layer `index`'s Q, K and V of h's norm, Q's
        and K's heads rotated (RoPE). h, delta: (T, hidden) contiguous; cos, sin:
        (T, head_dim) contiguous -> views of one (T, (heads + 2 kv_heads) * head_dim)
        output: q (T, heads, head_dim), k and v (T, kv_heads, head_dim)."""
        w, rows = self.layers[index], h.shape[0]
        out = torch.empty(rows, self.n, dtype=self.dtype)
        status = self._qkv(
            h.data_ptr(), None if delta is None else delta.data_ptr(),
            w.input_norm.data_ptr(), self.eps, w.qkv.values.data_ptr(),
            None if w.qkv_bias is None else w.qkv_bias.data_ptr(), cos.data_ptr(),
            sin.data_ptr(), cos.stride(0), out.data_ptr(), rows, self.hidden, self.heads,
            self.kv_heads, self.head_dim, torch.get_num_threads(), DTYPES[self.dtype],
            self.stream,
        )  # fmt: skip
        raise_for(status, "LayerKernels.qkv", ERRORS)
        q, k, v = out.split([self.q_dim, self.kv_dim, self.kv_dim], dim=1)
        return (q.view(rows, self.heads, self.head_dim), k.view(rows, self.kv_heads, self.head_dim),
                v.view(rows, self.kv_heads, self.head_dim))  # fmt: skip

    def mlp(self, index: int, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """h += attn's O projection (in place); layer `index`'s MLP of h's norm.
        h: (T, hidden) contiguous; attn: (T, heads * head_dim), rows contiguous -> (T, hidden)."""
        w, rows = self.layers[index], h.shape[0]
        if attn.dtype != self.dtype or attn.shape != (rows, self.q_dim):
            raise ValueError(f"attn must be ({rows}, {self.q_dim}) {self.dtype}; got "
                             f"{tuple(attn.shape)} {attn.dtype}")  # fmt: skip
        if attn.stride(1) != 1:
            attn = attn.contiguous()
        out = torch.empty(rows, self.hidden, dtype=self.dtype)
        status = self._mlp(
            h.data_ptr(), attn.data_ptr(), attn.stride(0), w.o.values.data_ptr(),
            w.post_norm.data_ptr(), self.eps, w.gate_up.values.data_ptr(),
            w.down.values.data_ptr(), out.data_ptr(), rows, self.hidden, self.q_dim, self.inter,
            torch.get_num_threads(), DTYPES[self.dtype], self.stream,
        )  # fmt: skip
        raise_for(status, "LayerKernels.mlp", ERRORS)
        return out


def matmul_seconds() -> float:
    """Wall seconds the layer calls have spent in their matmuls since the library loaded."""
    total = ctypes.c_uint64()
    status = native_function("kvlab_layer_matmul_ns", [PTR])(ctypes.addressof(total))
    raise_for(status, "matmul_seconds", ERRORS)
    return total.value * 1e-9
