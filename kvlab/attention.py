"""Attention over the KV pool, in plain torch: the reference every kernel is checked against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvlab.attention_metadata import AttentionMetadata
from kvlab.cache.pool import KVPool


def pooled_attention(
    q: torch.Tensor, layer: int, pool: KVPool, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Causal GQA attention of packed queries over each sequence's cached context.

    q: (T, heads, head_dim), rows packed sequence by sequence -> (T, heads, head_dim).
    The new tokens' K/V must already be written to the pool.
    """
    batch, q_max = meta.query_valid.shape
    k, v = pool.gather(layer, meta.context_slots)  # (B, S, kv_heads, head_dim)
    k, v = k.to(q.dtype), v.to(q.dtype)
    key_pos = torch.arange(k.shape[1], device=q.device)

    padded_q = q.new_zeros(batch, q_max, *q.shape[1:])  # (B, Q, heads, head_dim)
    padded_q[meta.query_valid] = q
    # Padded keys (past context_lens) sit right of every real query: causality masks them.
    causal = key_pos[None, None, :] <= meta.query_pos[:, :, None]  # (B, Q, S)
    out = F.scaled_dot_product_attention(
        padded_q.transpose(1, 2),  # (B, heads, Q, head_dim)
        k.transpose(1, 2),  # (B, kv_heads, S, head_dim)
        v.transpose(1, 2),
        attn_mask=causal[:, None],
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(1, 2)[meta.query_valid]  # (T, heads, head_dim)
