"""Attention statistics for score-based retention, collected on the torch reference path.

`ScoredAttention` wraps an attention function: it returns exactly what the wrapped one
returns, and adds the attention mass each physical block receives to `scores`, summed
over heads and each sequence's last `rows` query rows of the step, in every layer. The
mass is recomputed from Q and the gathered K (scaled_dot_product_attention does not
return its weights), so it costs one extra (rows x context) score matrix per layer.
"""

from __future__ import annotations

import torch

from kvlab.cache.pool import KVPool
from kvlab.model.metadata import AttentionMetadata

SCORED_ROWS = 16  # query rows per sequence and step whose attention is counted


class ScoredAttention:
    def __init__(self, inner, scores: torch.Tensor, block_size: int, rows: int = SCORED_ROWS):
        self.inner = inner  # the attention function whose outputs are returned
        self.scores = scores  # (num_blocks,) float64, accumulated in place
        self.block_size = block_size
        self.rows = rows

    def __call__(
        self, q: torch.Tensor, layer: int, pool: KVPool, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        out = self.inner(q, layer, pool, meta, scale)
        heads, head_dim = q.shape[1:]
        for group in meta.groups:
            k, _ = pool.gather(layer, group.slots)  # (G, S, kv_heads, head_dim)
            count, width = group.slots.shape
            grouped_q = q[group.rows].view(count, -1, heads, head_dim)  # (G, Q, heads, hd)
            queries = grouped_q.shape[1]
            first = queries - min(queries, self.rows)
            observed = grouped_q[:, first:]  # (G, R, heads, head_dim)
            k = k.to(q.dtype).repeat_interleave(heads // k.shape[2], dim=2)  # (G, S, heads, hd)
            logits = torch.einsum("grhd,gshd->ghrs", observed, k) * scale  # (G, heads, R, S)
            if group.mask is None:  # a whole prompt: row r sees columns <= its position
                row = torch.arange(first, queries, device=q.device)
                visible = torch.arange(width, device=q.device)[None, :] <= row[:, None]
                visible = visible[None, None]  # (1, 1, R, S)
            else:
                visible = group.mask[:, :, first:, :]  # (G, 1, R, S)
            weights = logits.masked_fill(~visible, float("-inf")).softmax(-1)
            mass = weights.sum(dim=(1, 2))  # (G, S)
            blocks = (group.slots // self.block_size).reshape(-1)
            self.scores.index_add_(
                0, blocks.to(self.scores.device), mass.reshape(-1).double().cpu()
            )
        return out
