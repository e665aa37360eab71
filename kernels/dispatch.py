"""Pick the implementation: Triton on CUDA, native C on the CPU, the torch reference else.

    paged_decode_attention(..., backend=None)   kv_write(..., backend=None)

`backend` None reads $KVLAB_KERNELS ("auto" if unset): "auto" is Triton for CUDA tensors,
the native CPU decode kernel (cpu_decode.py) for CPU tensors where a C compiler built it,
and torch otherwise; "triton" forces the Triton kernels (on CPU tensors they run under
Triton's interpreter, numpy-backed and slow: tests and notebooks, on small shapes); "cpu"
forces the native kernel; "torch" forces the reference. The CPU kernel reads float K/V
(the model's dtype, fp16, bf16): scaled codecs (int8, fp8) and every KV write take the
torch reference on the CPU.

Triton decides when it is imported whether @triton.jit functions (its own included) are
compiled or interpreted, by TRITON_INTERPRET: to run the kernels on CPU tensors, set
TRITON_INTERPRET=1 before the first `import triton` of the process.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from .cpu_build import cpu_kernels_available, cpu_kernels_error
from .cpu_decode import cpu_paged_decode_attention

BACKENDS = ("auto", "triton", "cpu", "torch")
CPU_CODECS = (None, "fp16", "bf16")  # the stored floats the native CPU kernel reads
ENV = "KVLAB_KERNELS"


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def choose_backend(device: torch.device | str, backend: str | None = None) -> str:
    """ "triton", "cpu" or "torch" for tensors on `device` (see the module docstring)."""
    choice = backend or os.environ.get(ENV, "auto")
    if choice not in BACKENDS:
        where = f"${ENV}" if backend is None else "backend"
        raise ValueError(f"{where}={choice!r} is unknown; choose one of {BACKENDS}")
    kind = torch.device(device).type
    if choice == "auto":
        if kind == "cuda" and triton_available():
            return "triton"
        return "cpu" if kind == "cpu" and cpu_kernels_available() else "torch"
    if choice == "triton" and not triton_available():
        raise ValueError("backend 'triton' needs the triton package: pip install triton")
    if choice == "cpu" and not (kind == "cpu" and cpu_kernels_available()):
        why = cpu_kernels_error() if kind == "cpu" else f"tensors on {kind}, not the CPU"
        raise ValueError(f"backend 'cpu' (the native CPU kernel) cannot run: {why}")
    return choice


def _triton_impl(module: str, function: str, device: torch.device):
    """`function` of kernel `module`, after checking that its kernels can run on `device`."""
    mod = importlib.import_module(f"{__package__}.{module}")
    interpreted = type(mod._KERNELS[0]).__name__ == "InterpretedFunction"
    if device.type != "cuda" and not interpreted:
        raise RuntimeError(
            f"the Triton kernels need CUDA tensors, or Triton's interpreter for {device.type} "
            "tensors: set TRITON_INTERPRET=1 before triton is first imported (tests and "
            "notebooks do it first thing), or use backend='torch'"
        )
    return getattr(mod, function)


def paged_decode_attention_triton(q: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The Triton kernel, built to run on q's device (interpreted on CPU); arguments as in
    kvlab.kernels.decode_attention.paged_decode_attention_triton."""
    fn = _triton_impl("decode_attention", "paged_decode_attention_triton", q.device)
    return fn(q, *args, **kwargs)


def kv_write_triton(k: torch.Tensor, *args, **kwargs) -> None:
    """The Triton KV write, built to run on k's device (interpreted on CPU)."""
    return _triton_impl("cache_write", "kv_write_triton", k.device)(k, *args, **kwargs)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    block_size: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    kv_codec: str | None = None,
    num_splits: int | None = None,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """Decode attention over a paged KV cache -> (B, heads, head_dim).

    See kvlab.kernels.decode_attention for the shapes; `backend` as in this module.
    """
    args = (q, k_cache, v_cache, block_tables, context_lens, scale, block_size)
    args += (k_scale, v_scale, kv_codec, num_splits)
    choice = choose_backend(q.device, backend)
    if choice == "cpu" and kv_codec in CPU_CODECS:  # float K/V: read in place
        span = torch.arange(block_tables.shape[1] * block_size)  # (S,) positions
        slots = block_tables.long()[:, span // block_size] * block_size + span % block_size
        flat = (c.flatten(0, 1) if c.dim() == 4 else c for c in (k_cache, v_cache))
        return cpu_paged_decode_attention(q, *flat, slots, context_lens.long(), scale)
    if choice in ("torch", "cpu"):
        from .decode_attention import paged_decode_attention_ref

        return paged_decode_attention_ref(*args)
    return paged_decode_attention_triton(*args)


def kv_write(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    kv_codec: str | None = None,
    *,
    backend: str | None = None,
) -> None:
    """Scatter (and quantize) new K/V into their slots. See kvlab.kernels.cache_write."""
    args = (k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale, kv_codec)
    if choose_backend(k.device, backend) in ("torch", "cpu"):  # no native CPU write
        from .cache_write import kv_write_ref

        return kv_write_ref(*args)
    return kv_write_triton(*args)
