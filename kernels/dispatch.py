"""Pick the implementation: Triton on CUDA, the torch reference elsewhere.

    paged_decode_attention(..., backend=None)   kv_write(..., backend=None)

`backend` None reads $KVLAB_KERNELS ("auto" if unset): "auto" is Triton for CUDA tensors
and torch otherwise; "triton" forces the kernels (on CPU tensors they run under Triton's
interpreter, numpy-backed and slow: tests and notebooks, on small shapes); "torch"
forces the reference.

Triton decides when it is imported whether @triton.jit functions (its own included) are
compiled or interpreted, by TRITON_INTERPRET: to run the kernels on CPU tensors, set
TRITON_INTERPRET=1 before the first `import triton` of the process.
"""

from __future__ import annotations

import importlib.util
import os

import torch

BACKENDS = ("auto", "triton", "torch")
ENV = "KVLAB_KERNELS"


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def choose_backend(device: torch.device | str, backend: str | None = None) -> str:
    """ "triton" or "torch" for tensors on `device` (see the module docstring)."""
    choice = backend or os.environ.get(ENV, "auto")
    if choice not in BACKENDS:
        where = f"${ENV}" if backend is None else "backend"
        raise ValueError(f"{where}={choice!r} is unknown; choose one of {BACKENDS}")
    if choice == "auto":
        return "triton" if torch.device(device).type == "cuda" and triton_available() else "torch"
    if choice == "triton" and not triton_available():
        raise ValueError("backend 'triton' needs the triton package: pip install triton")
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
    if choose_backend(q.device, backend) == "torch":
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
    if choose_backend(k.device, backend) == "torch":
        from .cache_write import kv_write_ref

        return kv_write_ref(*args)
    return kv_write_triton(*args)
