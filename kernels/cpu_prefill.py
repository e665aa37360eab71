"""Prompt attention on the CPU: a native kernel for the new rows of one sequence.

    out = cpu_paged_prefill_attention(q, k_cache, v_cache, slots, scale)

q holds the Q newest positions of a sequence whose S = len(slots) positions are all in the
pool (the new ones written already); row i, at position S - Q + i, attends causally to
positions 0 .. S - Q + i. One call covers a whole prompt, a prompt behind a prefix hit and a
later chunk of a chunked prefill.

`cpu_prefill.c` packs the sequence's K (transposed) and V into fp32 buffers, each pool
record read once, then runs flash attention in tasks of one kv head and 16 query positions,
whose g = heads / kv_heads query heads share every K and V value: scores and weighted
values in register tiles of 6 rows, the CPU's matmul rate where torch's CPU flash
attention (with a (Q, S) mask for a prefix hit) reaches about half of it; an online
softmax in fp32 with the polynomial e^x of the decode kernel. Tasks come from a shared
counter on the calling thread and the library's helper pthreads (cpu_pool.c); they depend
only on the shapes, so the output is bit-identical for any thread count.

Shapes: q (Q, heads, head_dim) float32/bfloat16 (float16 where the compiler has _Float16),
head_dim a multiple of 16; k_cache, v_cache (num_slots, kv_heads, head_dim), same dtypes,
last dim contiguous (a layer view `storage[layer]` works); slots (S,) int64, S >= Q >= 1.
Output (Q, heads, head_dim) in q's dtype. No autograd.

`cpu_paged_prefill_attention_batch` runs several sequences' rows in one call (a whole
step, decodes as one-row sequences), each row the same bits as in a call of its own:
tasks are per sequence, taken from one counter.

This module imports only torch and the standard library.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from .cpu_build import DTYPES, cpu_flags, native_function, raise_for, rows_contiguous
from .cpu_decode import check_q_and_caches

ERRORS = {  # kvlab_paged_prefill's return codes
    1: "invalid arguments",
    2: "slots must cover q's rows: S >= Q >= 1",
    3: "every slot must be in [0, num_slots)",
    5: "this CPU, OS or build has no AMX-BF16 tiles",
}
SIGNATURE = (
    [ctypes.c_void_p] * 4  # q, k, v, out
    + [ctypes.c_int] * 2  # dtype_q, dtype_kv
    + [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]  # slots, Q, S
    + [ctypes.c_int64] * 5  # num_slots, k and v slot/head strides
    + [ctypes.c_int] * 3  # heads, kv_heads, head_dim
    + [ctypes.c_float, ctypes.c_int]  # scale, num_threads
)
BATCH_SIGNATURE = (
    [ctypes.c_void_p] * 4  # q, k, v, out
    + [ctypes.c_int] * 2  # dtype_q, dtype_kv
    + [ctypes.c_void_p, ctypes.c_int64]  # slots, slots_stride
    + [ctypes.c_void_p] * 2  # starts, lens
    + [ctypes.c_int, ctypes.c_int64]  # B, num_slots
    + [ctypes.c_int64] * 4  # k and v slot/head strides
    + [ctypes.c_int] * 3  # heads, kv_heads, head_dim
    + [ctypes.c_float, ctypes.c_int]  # scale, num_threads
)
AMX_SIGNATURE = (
    [ctypes.c_void_p] * 4  # q, k, v, out
    + [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]  # slots, Q, S
    + [ctypes.c_int64] * 5  # num_slots, k and v slot/head strides
    + [ctypes.c_int] * 3  # heads, kv_heads, head_dim
    + [ctypes.c_float, ctypes.c_int]  # scale, num_threads
)
VECTOR = 16  # head_dim must be a multiple of it
AMX_DIMS = range(32, 257, 32)  # the head sizes the AMX kernel takes


def prefill_fits(head_dim: int) -> bool:
    """Whether the kernel takes this head size (a multiple of 16)."""
    return head_dim % VECTOR == 0


@functools.cache
def prefill_pays() -> bool:
    """Whether the kernel outruns torch's attention here: where the library is built for
    AVX-512, or for AVX2 with FMA (`kvlab_prefill_tiles_fit`, which asks the compiler's
    target, so a build without -march=native answers for itself).

    Its register tiles are rows of 16 floats (one 512-bit register) with AVX-512 and of 8
    (one 256-bit register) with AVX2, sized so a tile's accumulators fill the registers
    (cpu_tiles.h). On a 2-core AMD EPYC with AVX2 only, 16-float tiles split in two no
    longer fitted and ran at 3-6 GFLOP/s where torch's reference reached 23-39; 8-float
    tiles run at 42-53 GFLOP/s on its large prompt shapes (benchmarks/cpu_kernels.py).
    Elsewhere, or without the library, prompts take the reference
    (kvlab.model.cpu_attention); the kernel still runs when called directly.
    """
    try:
        return bool(native_function("kvlab_prefill_tiles_fit", [])())
    except RuntimeError:  # the library is unavailable
        return False


@functools.cache
def amx_ready() -> bool:
    """Whether bf16 prompts can run on AMX tiles here (kernels/cpu_amx.c): the CPU has
    AMX-BF16, AVX-512 and AVX512-BF16, the compiler knew the instructions, and Linux
    granted this process the tile registers. Asked of the CPU, never assumed from the
    build."""
    try:
        return bool(native_function("kvlab_amx_ready", [])())
    except RuntimeError:  # the library is unavailable
        return False


def amx_takes(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the AMX kernel can compute these tensors: bf16 queries and cache, a head
    size in AMX_DIMS."""
    return q.dtype == k_cache.dtype == torch.bfloat16 and q.shape[-1] in AMX_DIMS


def on_amx(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether cpu_paged_prefill_attention takes the AMX kernel for these tensors by
    default: `amx_takes` them and amx_ready()."""
    return amx_takes(q, k_cache) and amx_ready()


def prompt_pays(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether a prompt's attention runs faster through kvlab's kernel than through torch's
    (kvlab.model.cpu_attention asks), decided from what the CPU and the build can do:
    bf16 where the AMX kernel runs (`on_amx`): the kernel; bf16 elsewhere on a CPU with
    AMX-BF16 (whose tile unit oneDNN's bf16 matmuls under torch's attention use): torch,
    since the register tiles widen bf16 to fp32 and run on the FMAs (on the Xeon with AMX
    they ran 1.4 to 2.6 times slower than torch's attention on four of five prompt shapes,
    level on the fifth: benchmarks/results/cpu_kernels.avx512.json, tiles_ms); otherwise,
    bf16 on a CPU with AVX512-BF16 and no AMX among them, the tiles where they fit the build
    (`prefill_pays`) and the head size (`prefill_fits`) (on the AMD EPYC with AVX512-BF16
    they ran 1.3 to 3.5 times faster than torch's bf16 attention on the same five shapes
    with bf16 widened to fp32, 1.9 to 4.9 times in bf16 pairs:
    benchmarks/results/cpu_kernels_epyc.avx512.json, the latter).
    """
    if on_amx(q, k_cache):
        return True
    bf16 = q.dtype == k_cache.dtype == torch.bfloat16
    if bf16 and "amx_bf16" in cpu_flags():
        return False
    return prefill_pays() and prefill_fits(q.shape[-1])


def cpu_paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    amx: bool | None = None,
) -> torch.Tensor:
    """Causal GQA attention of a sequence's Q newest rows over its S slots; see above.

    out: where to write the result, a contiguous (Q, heads, head_dim) tensor of q's dtype
    (a slice of the step's output rows saves a copy); None allocates one.
    amx: True runs the bf16 AMX kernel (kernels/cpu_amx.c: bf16 products summed in fp32,
    weights rounded to bf16 as the tile unit takes them), False the fp32 register tiles,
    None the AMX kernel where `on_amx` says so.
    """
    check_q_and_caches(q, k_cache, v_cache, scale, "Q", slots=slots)
    rows, heads, head_dim = q.shape
    if slots.dim() != 1 or not 1 <= rows <= slots.shape[0]:
        raise ValueError(
            f"slots must be (S,) with S >= Q >= 1; got {tuple(slots.shape)} for Q = {rows}"
        )
    if not prefill_fits(head_dim):
        raise ValueError(f"head_dim must be a multiple of {VECTOR}; got {head_dim}")
    amx = on_amx(q, k_cache) if amx is None else amx
    if amx and not amx_takes(q, k_cache):
        raise ValueError(
            f"the AMX kernel takes bf16 q and caches with head_dim in 32, 64, .., 256; "
            f"got {q.dtype}, {k_cache.dtype}, head_dim {head_dim}"
        )
    if amx:  # bf16 only: no dtype arguments
        kernel, types = native_function("kvlab_paged_prefill_amx", AMX_SIGNATURE), ()
    else:
        kernel = native_function("kvlab_paged_prefill", SIGNATURE, q.dtype, k_cache.dtype)
        types = (DTYPES[q.dtype], DTYPES[k_cache.dtype])
    q = q.detach().contiguous()
    k_cache, v_cache = rows_contiguous(k_cache), rows_contiguous(v_cache)
    slots = slots.contiguous()
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {tuple(q.shape)} {q.dtype} tensor")
    status = kernel(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        out.data_ptr(),
        *types,
        slots.data_ptr(),
        rows,
        slots.shape[0],
        k_cache.shape[0],
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        heads,
        k_cache.shape[1],
        head_dim,
        float(scale),
        torch.get_num_threads(),
    )
    raise_for(status, "cpu_paged_prefill_attention", ERRORS)
    return out


def cpu_paged_prefill_attention_batch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    starts: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """cpu_paged_prefill_attention for B sequences in one call.

    q: (R, heads, head_dim), sequence b's rows at starts[b] .. starts[b + 1] - 1 (the last
    of its lens[b] positions); slots: (B, S) int64, row b's first lens[b] its slots;
    starts: (B + 1,) int64 from 0; lens: (B,) int64. -> (R, heads, head_dim).
    """
    check_q_and_caches(q, k_cache, v_cache, scale, "R", slots=slots, starts=starts, lens=lens)
    batch = lens.shape[0]
    if slots.dim() != 2 or slots.shape[0] != batch or tuple(starts.shape) != (batch + 1,):
        raise ValueError(
            f"slots must be (B, S), starts (B + 1,) and lens (B,); got {tuple(slots.shape)}, "
            f"{tuple(starts.shape)}, {tuple(lens.shape)}"
        )
    if batch < 1 or int(starts[-1]) != q.shape[0]:
        raise ValueError(f"starts must end at q's {q.shape[0]} rows; got {starts.tolist()}")
    if not prefill_fits(q.shape[-1]):
        raise ValueError(f"head_dim must be a multiple of {VECTOR}; got {q.shape[-1]}")
    kernel = native_function("kvlab_paged_prefill_batch", BATCH_SIGNATURE, q.dtype, k_cache.dtype)
    q = q.detach().contiguous()
    k_cache, v_cache = rows_contiguous(k_cache), rows_contiguous(v_cache)
    slots = slots if slots.stride(1) == 1 else slots.contiguous()
    starts, lens = starts.contiguous(), lens.contiguous()
    out = torch.empty_like(q)
    status = kernel(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        out.data_ptr(),
        DTYPES[q.dtype],
        DTYPES[k_cache.dtype],
        slots.data_ptr(),
        slots.stride(0),
        starts.data_ptr(),
        lens.data_ptr(),
        batch,
        k_cache.shape[0],
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        q.shape[1],
        k_cache.shape[1],
        q.shape[2],
        float(scale),
        torch.get_num_threads(),
    )
    raise_for(status, "cpu_paged_prefill_attention_batch", ERRORS)
    return out
