"""Cascade attention for a decode step whose sequences share a prefix (bf16, AMX tiles).

When many sequences decode behind one cached prompt prefix (a shared system prompt or
document), each one's decode attention reads that prefix's K/V again. Cascade attention
(FlashInfer's name; vLLM's FlashAttention backend did it on GPUs until vLLM removed it,
and its CPU backend never did) splits each sequence's context in two:

    shared   positions 0 .. P - 1, the same slots in every sequence: all B queries attend
             to them in one call, as a matrix product of (B x heads) rows against the P
             positions on AMX tiles (cpu_amx.c's kvlab_prefix_amx): the prefix is read once
             per kv head instead of once per sequence, and the tile unit does the products.
    own      positions P .. len - 1 of each sequence: the decode kernel (cpu_decode.c), which
             merges the shared part's (output, log-sum-exp) in first, as one more chunk.

Softmax over the whole context is the two parts' softmaxes weighted by their denominators
(the log-sum-exp merge flash attention uses between chunks), so the result is attention
over every position; the shared part rounds its weights to bf16 for the tile unit, as the
AMX prompt kernel does. `cascade_pays` says when to take it: where the decode kernel would
read the prefix again many times. That kernel already reads a chunk that up to M =
`decode_members()` sequences share (cpu_decode.c's MAX_MEMBERS, 16) once for all of them, so
cascade attention saves the prefix's reads beyond the first M sequences, and it costs a
second call and a merge. It is taken where the prefix positions the decode kernel would
read again, shared x (B - M) / M, are at least MIN_REREAD, and shared >= 256
(the first rule of vLLM's former `use_cascade_attention`). Measured on the 2-core
Xeon (`python benchmarks/cascade.py`, one layer): at 8 sequences cascade attention was
slower than the decode kernel alone on every prefix from 304 to 2,048 positions, at 16
within about 20% either way, at 32 faster from 640 positions, at 64 from 304; on the
doc-QA workload in bf16 (a 304-position preamble, 8 to 32 sequences with ~1,100-position
contexts) taking it by vLLM's two rules (256 positions, 8 sequences) made the decode steps'
attention about 12% slower than the decode kernel alone.

This module imports only torch and the standard library.
"""

from __future__ import annotations

import ctypes

import torch

from .cpu_build import native_function, raise_for, rows_contiguous
from .cpu_decode import cpu_paged_decode_attention, decode_members
from .cpu_prefill import amx_ready, amx_takes

MIN_SHARED = 256  # positions; the threshold of vLLM's former use_cascade_attention
MIN_REREAD = 640  # prefix positions the decode kernel would read again, at least
ERRORS = {1: "invalid arguments", 2: "invalid lengths", 3: "a slot out of range",
          5: "this CPU, kernel or build has no AMX-BF16"}  # fmt: skip
PREFIX_SIGNATURE = (
    [ctypes.c_void_p] * 5  # q, k, v, out, lse
    + [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]  # slots, Q, S
    + [ctypes.c_int64] * 5  # num_slots, k and v slot/head strides
    + [ctypes.c_int] * 3  # heads, kv_heads, head_dim
    + [ctypes.c_float, ctypes.c_int]  # scale, num_threads
)


def cascade_pays(q: torch.Tensor, k_cache: torch.Tensor, shared: int) -> bool:
    """Whether a decode step of q's B sequences sharing their first `shared` positions
    takes cascade attention: bf16 on a CPU whose tile unit runs, shared >= MIN_SHARED and
    the positions the decode kernel would read again, shared x (B - M) / M for M =
    decode_members(), at least MIN_REREAD (see above)."""
    if not (shared >= MIN_SHARED and amx_takes(q, k_cache) and amx_ready()):
        return False
    members = decode_members()
    again = shared * (q.shape[0] - members)  # read again, x members: exact in integers
    return again >= MIN_REREAD * members


def cpu_cascade_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    shared: int,
    verified: bool = False,
) -> torch.Tensor:
    """cpu_paged_decode_attention's result, the first `shared` positions (the same slots in
    every sequence) attended once for all sequences.

    q: (B, heads, head_dim) bf16; k_cache, v_cache: (num_slots, kv_heads, head_dim) bf16;
    slots (B, S) and lens (B,) int64 as cpu_paged_decode_attention takes them -> (B, heads,
    head_dim) bf16. ValueError unless 0 < shared < min(lens), every sequence's first
    `shared` slots are the same, and the tile unit runs here. `verified`: the caller found
    `shared` by comparing these slots (kvlab.model.metadata's
    AttentionGroup.shared_positions, once per step), so they are not compared again.
    """
    if not (amx_takes(q, k_cache) and amx_ready()):
        raise ValueError("cascade attention needs bf16 q and caches and a CPU with AMX-BF16")
    if not 0 < shared < int(lens.min()):
        raise ValueError(f"shared must be in [1, min(lens)); got {shared}")
    prefix = slots[0, :shared].contiguous()  # (P,)
    if not verified and not bool((slots[:, :shared] == prefix).all()):  # another's K/V
        raise ValueError(f"the sequences' first {shared} slots are not the same")
    q = q.detach().contiguous()
    k_cache, v_cache = rows_contiguous(k_cache), rows_contiguous(v_cache)
    batch, heads, head_dim = q.shape
    out = torch.empty(q.shape, dtype=torch.float32)  # over the prefix alone
    lse = torch.empty(batch, heads, dtype=torch.float32)
    status = native_function("kvlab_prefix_amx", PREFIX_SIGNATURE)(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), lse.data_ptr(),
        prefix.data_ptr(), batch, shared, k_cache.shape[0], k_cache.stride(0),
        k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), heads, k_cache.shape[1],
        head_dim, float(scale), torch.get_num_threads(),
    )  # fmt: skip
    raise_for(status, "cpu_cascade_decode_attention", ERRORS)
    return cpu_paged_decode_attention(
        q, k_cache, v_cache, slots[:, shared:], lens - shared, scale, prior=(out, lse)
    )
