"""KernelAttention's CPU path: decodes in place through the native kernel, prompts in two
flash calls.

Every group of meta.groups (kvlab.model.metadata) is one of two kinds:

* **Decodes** (one query row each): `kvlab.kernels.cpu_paged_decode_attention` reads each
  sequence's K/V where they lie in the pool, through the group's slots, instead of the
  reference's copy of them into a padded tensor. Also in a step that mixes decodes with a
  prompt.
* **A prompt after cached tokens** (a prefix hit, a later chunk): the reference runs one
  scaled_dot_product_attention with a (Q, S) mask, and a masked flash attention computes
  every one of the Q x S scores. Here the Q new rows attend twice, unmasked to the P = S - Q
  cached keys and causally to their own Q keys (the upper triangle skipped), and the two
  results merge by their log-sum-exps:
      out = (e^lse_a out_a + e^lse_b out_b) / (e^lse_a + e^lse_b).
  That saves work where the new part is the longer one (Q > P: a prompt behind a shared
  system prompt); the rest keep the reference's call.

A whole prompt with nothing cached is the reference's plain causal call already.
"""

from __future__ import annotations

import torch

from kvlab.cache.pool import KVPool
from kvlab.model.attention import group_attention
from kvlab.model.metadata import AttentionGroup, AttentionMetadata

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # -> (out, lse)


def cpu_attention(
    q: torch.Tensor, layer: int, pool: KVPool, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """pooled_attention's result, computed as the module docstring says.

    q: (T, heads, head_dim) -> (T, heads, head_dim). The pool's codec must be one of
    kvlab.kernels.dispatch.CPU_CODECS and the native kernel built
    (kvlab.kernels.cpu_decode_available).
    """
    from kvlab.kernels import cpu_paged_decode_attention
    from kvlab.model.kernel_attention import pool_layer  # which imports this module

    out = torch.empty_like(q)
    stored = pool_layer(pool, layer)
    k_cache, v_cache = stored["k_cache"], stored["v_cache"]
    for group in meta.groups:
        rows = q[group.rows]  # (G * Q, heads, head_dim)
        if group.lens is not None:  # decodes: (G, heads, head_dim)
            out[group.rows] = cpu_paged_decode_attention(
                rows, k_cache, v_cache, group.slots, group.lens, scale
            )
        elif group.mask is not None and 2 * rows.shape[0] > group.slots.shape[1]:  # Q > P
            out[group.rows] = _split_prompt(rows, layer, pool, group, scale)
        else:
            out[group.rows] = group_attention(rows, layer, pool, group, scale)
    return out


def _split_prompt(
    q: torch.Tensor, layer: int, pool: KVPool, group: AttentionGroup, scale: float
) -> torch.Tensor:
    """Q new rows after P cached keys: q (Q, heads, head_dim) -> the same shape."""
    heads = q.shape[1]
    k, v = pool.gather(layer, group.slots)  # (1, S, kv_heads, head_dim)
    cached = k.shape[1] - q.shape[0]  # P
    k, v = (x[0].to(q.dtype).transpose(0, 1) for x in (k, v))  # (kv_heads, S, head_dim)
    k, v = (x.repeat_interleave(heads // x.shape[0], 0)[None] for x in (k, v))  # (1, heads, S, d)
    rows = q.transpose(0, 1)[None]  # (1, heads, Q, head_dim)
    out_a, lse_a = _flash(rows, k[:, :, :cached], v[:, :, :cached], 0.0, False, scale=scale)
    out_b, lse_b = _flash(rows, k[:, :, cached:], v[:, :, cached:], 0.0, True, scale=scale)
    top = torch.maximum(lse_a, lse_b)  # (1, heads, Q)
    w_a, w_b = ((lse - top).exp()[..., None] for lse in (lse_a, lse_b))
    merged = (out_a.float() * w_a + out_b.float() * w_b) / (w_a + w_b)
    return merged[0].transpose(0, 1).to(q.dtype)  # (Q, heads, head_dim)
