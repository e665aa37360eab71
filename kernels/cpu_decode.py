"""Paged decode attention on the CPU: a native kernel that reads K/V in place from the pool.

The torch path (kvlab.model.attention.pooled_attention) copies every sequence's K/V into a
padded (B, S, kv_heads, head_dim) tensor each decode step, then runs
scaled_dot_product_attention over it. Decode is memory-bound, so that copy roughly triples
the memory traffic. `cpu_decode.c` instead reads each K and V row once, where it lies:

* **Slots.** Position j of sequence b lives in slot `slots[b, j]` of the layer's
  (num_slots, kv_heads, head_dim) storage; positions >= lens[b] are never read (their
  slots may hold anything, NaN included).
* **One task per chunk of a sequence.** A task covers up to 256 positions of one sequence
  for all its heads: a slot's K for every kv head is one contiguous record (likewise V), so
  the records are read front to back, each value once, and used for all the query heads
  that share its kv head (GQA). Longer sequences are split into such chunks, whose partial
  softmax results are merged by log-sum-exp; the chunks depend only on the lengths, so the
  output is bit-identical for any thread count.
* **Shared chunks read once.** Sequences behind one cached prompt prefix reach its
  positions through the same slots; a whole chunk that up to 16 of them read through the
  same slots is one task for all of them, each K and V record loaded once for every
  member's query heads. Each row's sums keep the order they have alone, so a sequence's
  output is the same bits with or without company.
* **Two passes, fp32.** Scores q . k_j * scale go to a (heads, chunk) fp32 buffer; each row
  gets softmax with max subtraction (a polynomial exp, ~1 ulp); the V pass accumulates
  p_j v_j in fp32 and divides by the sum. The output is rounded to q's dtype once.
* **Vectorised C, torch's threads.** 16-float GNU vectors (8-float without AVX-512); the
  score pass sums as many dot products' lanes together with a shuffle tree; bf16/fp16 are
  widened as they are loaded (bf16 q and K multiply in pairs, vdpbf16ps, where the build
  targets AVX512-BF16); records a few positions ahead are prefetched into L1
  (scattered blocks defeat the hardware prefetcher). The tasks are taken from a shared
  counter by the calling thread and `torch.get_num_threads() - 1` helpers: torch's own
  OpenMP threads where torch runs on OpenMP, else pthreads the library starts once and
  which sleep between calls (kernels/cpu_build.py). Calls from several Python threads run
  one at a time; a forked child starts its own helpers.

The C file is built with the other native kernels by kernels/cpu_build.py.

Shapes: q (B, heads, head_dim) float32/bfloat16 (float16 where the compiler has _Float16);
k_cache, v_cache (num_slots, kv_heads, head_dim), same dtypes, last dim contiguous (a layer
view `storage[layer]` works); slots (B, S) int64, row stride free; lens (B,) int64, each in
[1, S]. Output (B, heads, head_dim) in q's dtype. No autograd.

This module imports only torch and the standard library.
"""

from __future__ import annotations

import ctypes
import functools
import math

import torch

from .cpu_build import DTYPES, native_function, raise_for, rows_contiguous

ERRORS = {  # kvlab_paged_decode's return codes
    1: "invalid arguments",
    2: "every lens[b] must be in [1, S], S = slots.shape[1]",
    3: "slots[b, j] for j < lens[b] must be in [0, num_slots)",
}
SIGNATURE = (
    [ctypes.c_void_p] * 4  # q, k, v, out
    + [ctypes.c_int] * 2  # dtype_q, dtype_kv
    + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]  # slots, slots_stride, lens
    + [ctypes.c_int64] * 6  # max_len, num_slots, k and v slot/head strides
    + [ctypes.c_int] * 4  # B, heads, kv_heads, head_dim
    + [ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p]  # scale, prior_out, prior_lse
    + [ctypes.c_int]  # num_threads
)


@functools.cache
def decode_members() -> int:
    """Sequences one task of the kernel serves from a chunk they share (cpu_decode.c's
    MAX_MEMBERS, read from the library); RuntimeError where the library is unavailable."""
    return int(native_function("kvlab_decode_members", [])())


def cpu_paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    prior: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale) v per sequence over its first lens[b] slots, GQA; see above.

    prior: (out, lse), fp32 (B, heads, head_dim) and (B, heads): each row's attention over
    other positions and its log-sum-exp (cascade attention's shared prefix,
    kvlab.kernels.cpu_cascade), merged into the result as if those positions came first.
    """
    _check(q, k_cache, v_cache, slots, lens, scale)
    if prior is not None:
        shapes = (q.shape, q.shape[:2])
        if any(t.dtype != torch.float32 or t.shape != shape or not t.is_contiguous()
               for t, shape in zip(prior, shapes)):  # fmt: skip
            raise ValueError(f"prior must be contiguous fp32 tensors of shapes {shapes}")
    kernel = native_function("kvlab_paged_decode", SIGNATURE, q.dtype, k_cache.dtype)
    q = q.detach().contiguous()  # (B, heads, head_dim)
    k_cache, v_cache = rows_contiguous(k_cache), rows_contiguous(v_cache)
    slots = slots if slots.stride(1) == 1 else slots.contiguous()  # (B, S), any row stride
    lens = lens.contiguous()  # (B,)
    out = torch.empty_like(q)  # (B, heads, head_dim)
    if q.shape[0] > 0:
        status = kernel(*_arguments(q, k_cache, v_cache, out, slots, lens, scale, prior))
        raise_for(status, "cpu_paged_decode_attention", ERRORS)
    return out


# --- arguments ------------------------------------------------------------------------


def check_q_and_caches(q, k_cache, v_cache, scale, rows: str, **indices) -> None:
    """ValueError unless q (rows, heads, head_dim) and the caches fit the native kernels
    (shapes, dtypes, CPU), the index tensors are int64 on the CPU and scale is finite."""
    tensors = {"q": q, "k_cache": k_cache, "v_cache": v_cache, **indices}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            raise ValueError(f"{name} must be a CPU tensor")
    if q.dim() != 3 or k_cache.dim() != 3 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"q must be ({rows}, heads, head_dim) and k_cache, v_cache the same "
            f"(num_slots, kv_heads, head_dim); got {tuple(q.shape)}, "
            f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    heads, head_dim = q.shape[1:]
    kv_heads = k_cache.shape[1]
    if k_cache.shape[2] != head_dim or kv_heads == 0 or heads % kv_heads:
        raise ValueError(
            f"q {tuple(q.shape)} and the cache {tuple(k_cache.shape)} need the same head_dim "
            "and heads divisible by kv_heads"
        )
    if q.dtype not in DTYPES or k_cache.dtype not in DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            "q and the caches must be float32, bfloat16 or float16 (k and v alike); "
            f"got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    if any(t.dtype != torch.int64 for t in indices.values()):
        names = " and ".join(indices)
        got = ", ".join(str(t.dtype) for t in indices.values())
        raise ValueError(f"{names} must be int64; got {got}")
    if not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number; got {scale!r}")


def _check(q, k_cache, v_cache, slots, lens, scale) -> None:
    """ValueError unless the shapes, dtypes and devices fit the kernel."""
    check_q_and_caches(q, k_cache, v_cache, scale, "B", slots=slots, lens=lens)
    batch = q.shape[0]
    if slots.dim() != 2 or slots.shape[0] != batch or tuple(lens.shape) != (batch,):
        raise ValueError(
            f"slots must be (B, S) and lens (B,) with B = {batch}; "
            f"got {tuple(slots.shape)}, {tuple(lens.shape)}"
        )
    if batch and slots.shape[1] == 0:
        raise ValueError("slots must have at least one column")


def _arguments(q, k_cache, v_cache, out, slots, lens, scale, prior=None) -> tuple:
    """kvlab_paged_decode's arguments, in order."""
    batch, heads, head_dim = q.shape
    return (
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        out.data_ptr(),
        DTYPES[q.dtype],
        DTYPES[k_cache.dtype],
        slots.data_ptr(),
        slots.stride(0),
        lens.data_ptr(),
        slots.shape[1],
        k_cache.shape[0],
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        batch,
        heads,
        k_cache.shape[1],
        head_dim,
        float(scale),
        None if prior is None else prior[0].data_ptr(),
        None if prior is None else prior[1].data_ptr(),
        torch.get_num_threads(),
    )
