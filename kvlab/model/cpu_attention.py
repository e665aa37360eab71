"""KernelAttention's CPU path: every group through the native kernels, K/V read from the pool.

Every group of meta.groups (kvlab.model.metadata) is one of two kinds:

* **Decodes** (one query row each): `kvlab.kernels.cpu_paged_decode_attention` reads each
  sequence's K/V where they lie in the pool, through the group's slots, instead of the
  reference's copy of them into a padded tensor. Also in a step that mixes decodes with a
  prompt. When the group's sequences share a long prefix (the same slots: a cached system
  prompt or document) in bf16 where the CPU has AMX tiles, cascade attention
  (`kvlab.kernels.cpu_cascade`): the prefix attended once for all of them, then each
  sequence's own positions.
* **A prompt** (a whole one, one behind a prefix hit, a later chunk): its Q new rows are
  the last Q of its S context positions and row i sees the first S - Q + i + 1 of them
  (with a retention policy's dropped blocks too: their positions are not in the slots).
  A sliding window's prompt (kvlab.model.pattern) takes the reference's masked call.
  `kvlab.kernels.cpu_paged_prefill_attention` computes just that: flash attention in
  register tiles over the rows' causal spans, where the reference's
  scaled_dot_product_attention computes every one of the Q x S scores of a masked call.

Where the prompt kernel would not beat torch's attention
(`kvlab.kernels.cpu_prefill.prompt_pays`: a head size off its 16-float vectors, a library
built for neither AVX-512 nor AVX2 and FMA, bf16 on a CPU with AMX-BF16 but without the
AMX kernel), a prompt takes the reference's call.
"""

from __future__ import annotations

import torch

from kvlab.cache.pool import KVPool
from kvlab.model.attention import group_attention
from kvlab.model.kernel_args import pool_layer
from kvlab.model.metadata import AttentionGroup, AttentionMetadata


def cpu_attention(
    q: torch.Tensor, layer: int, pool: KVPool, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """pooled_attention's result, computed as the module docstring says.

    q: (T, heads, head_dim) -> (T, heads, head_dim). The pool's codec must be one of
    kvlab.kernels.dispatch.CPU_CODECS and the native kernels built
    (kvlab.kernels.cpu_kernels_available).
    """
    from kvlab.kernels import cpu_paged_prefill_attention
    from kvlab.kernels.cpu_prefill import prompt_pays

    stored = pool_layer(pool, layer)
    k_cache, v_cache = stored["k_cache"], stored["v_cache"]
    decodes = meta.decode_group()  # every decode in one call: the kernel needs no padding
    if decodes is not None and len(decodes.lens) == q.shape[0]:  # a decode step: every row
        return _decodes(q, k_cache, v_cache, decodes, scale)
    out = torch.empty_like(q)
    if decodes is not None:
        out[decodes.rows] = _decodes(q[decodes.rows], k_cache, v_cache, decodes, scale)
    for group in (group for group in meta.groups if group.lens is None):  # the prompts
        rows = q[group.rows]  # (Q, heads, head_dim)
        if meta.window is None and prompt_pays(q, k_cache):
            # one prompt: (Q, heads, head_dim), written in place
            cpu_paged_prefill_attention(
                rows, k_cache, v_cache, group.slots[0], scale, out=out[group.rows]
            )
        else:
            out[group.rows] = group_attention(rows, layer, pool, group, scale)
    return out


def _decodes(q, k_cache, v_cache, decodes: AttentionGroup, scale: float) -> torch.Tensor:
    """The decode group's attention: q (G, heads, head_dim), the group's rows -> the same.
    Cascade attention where its sequences share a long prefix (kvlab.kernels.cpu_cascade)."""
    from kvlab.kernels import cpu_paged_decode_attention
    from kvlab.kernels.cpu_cascade import cascade_pays, cpu_cascade_decode_attention

    shared = decodes.shared_positions()
    if cascade_pays(q, k_cache, shared):
        return cpu_cascade_decode_attention(
            q, k_cache, v_cache, decodes.slots, decodes.lens, scale, shared, verified=True
        )
    return cpu_paged_decode_attention(q, k_cache, v_cache, decodes.slots, decodes.lens, scale)
