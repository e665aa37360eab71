"""Triton kernels for kvlab, installed as `kvlab.kernels` (never as a top-level `kernels`).

Each kernel sits beside a pure-torch reference with the same signature; the dispatcher
(`dispatch.py`) runs Triton on CUDA and the reference elsewhere, and $KVLAB_KERNELS or a
`backend=` argument overrides it (on CPU the kernels then run under Triton's interpreter).
The torch path in `kvlab.model.attention` stays the reference the whole engine is checked against.

    decode_attention.py  paged decode attention: GQA, block-table walk, split-K, fused
                         int8/fp8 dequantization
    cache_write.py       KV write: scatter new K/V into their slots, quantizing to int8/fp8
    kv_codes.py          the codecs' bit layouts (kvlab.cache.codecs), in Triton and torch
    dispatch.py          Triton or torch
    cpu_decode.py        paged decode attention on the CPU: native C (cpu_decode.c), ctypes
    cpu_prefill.py       prompt attention on the CPU: native C (cpu_prefill.c), ctypes; a
                         batch of sequences in one call (batch-invariant mode's attention);
                         bf16 prompts on AMX tiles where the CPU has them (cpu_amx.c)
    cpu_cascade.py       cascade attention: bf16 decodes that share a prefix attend to it
                         once on AMX tiles (cpu_amx.c), then each to its own positions
    cpu_linear.py        a decode step's bf16 linears on AMX tiles (cpu_linear.c), each
                         weight packed once into the order the kernel streams it
    cpu_stream.py        a decode step's fp32 linears on the CPU's FMAs (cpu_stream.c), each
                         weight packed once into the order the kernel streams it
    cpu_packed.py        what the two packed linears share: packing, checks, the call
    cpu_fused.py         a bf16 or fp32 layer's norms with their residual adds, RoPE and
                         SwiGLU on the CPU, one native call each (cpu_fused.c)
    cpu_invariant.py     batch-invariant dot products and e^x on the CPU: native C
                         (cpu_invariant.c), each output's order fixed by its own inputs
    cpu_build.py         compiles and loads the native CPU kernels (and cpu_pool.c, their
                         threads) as one library
    _shadowed.py         imported as a bare `kernels` (Python started in the repository
                         root), hands that name to the installed `kernels` package

This package imports only torch and triton, so it loads on a GPU machine without the rest
of kvlab's dependencies.
"""

if __name__ == "kernels":  # the repository root on sys.path: see _shadowed.py
    from ._shadowed import load_installed

    load_installed()
else:
    from .cache_write import kv_write_ref
    from .cpu_build import cpu_kernels_available
    from .cpu_decode import cpu_paged_decode_attention
    from .cpu_prefill import cpu_paged_prefill_attention, cpu_paged_prefill_attention_batch
    from .decode_attention import auto_splits, paged_decode_attention_ref, walk
    from .dispatch import (
        choose_backend,
        kv_write,
        kv_write_triton,
        paged_decode_attention,
        paged_decode_attention_triton,
    )
    from .kv_codes import SCALED, decode_ref, encode_ref

__all__ = [
    "SCALED",
    "auto_splits",
    "choose_backend",
    "cpu_kernels_available",
    "cpu_paged_decode_attention",
    "cpu_paged_prefill_attention",
    "cpu_paged_prefill_attention_batch",
    "decode_ref",
    "encode_ref",
    "kv_write",
    "kv_write_ref",
    "kv_write_triton",
    "paged_decode_attention",
    "paged_decode_attention_ref",
    "paged_decode_attention_triton",
    "walk",
]
