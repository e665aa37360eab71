"""Attention over the KV pool, in plain torch: the reference every kernel is checked against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvlab.cache.pool import KVPool
from kvlab.model.metadata import AttentionGroup, AttentionMetadata


def pooled_attention(
    q: torch.Tensor, layer: int, pool: KVPool, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Causal GQA attention of packed queries over each sequence's cached context.

    q: (T, heads, head_dim), rows packed sequence by sequence -> (T, heads, head_dim).
    The new tokens' K/V must already be written to the pool. Runs one
    scaled_dot_product_attention per group of meta.groups (all decodes together, each
    prompt alone), so no sequence pays for another's length.
    """
    out = torch.empty_like(q)
    for group in meta.groups:
        out[group.rows] = group_attention(q[group.rows], layer, pool, group, scale)
    return out


def group_attention(
    q: torch.Tensor, layer: int, pool: KVPool, group: AttentionGroup, scale: float
) -> torch.Tensor:
    """One group's attention: q (G * Q, heads, head_dim), its rows -> the same shape."""
    k, v = pool.gather(layer, group.slots)  # (G, S, kv_heads, head_dim)
    count, kv_heads = group.slots.shape[0], k.shape[2]
    heads, head_dim = q.shape[1:]
    grouped_q = q.view(count, -1, heads, head_dim)  # (G, Q, heads, head_dim)
    fold = grouped_q.shape[1] == 1 and group.mask is not None  # decodes
    if fold:  # the query heads sharing a KV head become its query rows, so each KV
        # head is read once: (G, kv_heads, heads / kv_heads, head_dim)
        grouped_q = grouped_q.view(count, kv_heads, heads // kv_heads, head_dim)
    else:
        grouped_q = grouped_q.transpose(1, 2)  # (G, heads, Q, head_dim)
    attended = F.scaled_dot_product_attention(
        grouped_q,
        k.to(q.dtype).transpose(1, 2),  # (G, kv_heads, S, head_dim)
        v.to(q.dtype).transpose(1, 2),
        attn_mask=group.mask,  # (G, 1, Q, S): broadcast over heads (and folded rows)
        is_causal=group.mask is None,
        scale=scale,
        enable_gqa=not fold,
    )
    if fold:
        return attended.reshape(count, heads, head_dim)
    return attended.transpose(1, 2).reshape(-1, heads, head_dim)
