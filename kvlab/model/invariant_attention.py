"""Batch-invariant attention: each query row's result, bit for bit, whatever else runs.

`pooled_attention` hands each group to scaled_dot_product_attention, whose CPU kernel
blocks the work by the number of query rows (a whole prompt, a chunk, one decode) and
reads a decode group padded to its longest member: the same row comes out with other
rounding when its sequence is chunked, found in the prefix cache or batched with others.
Here every row is computed the same way wherever it sits, from kvlab's own fixed-order
dot products and e^x (kvlab.kernels.cpu_invariant):

* **Scores** `q . k * scale` for the row's g = heads / kv_heads query heads against every
  key its group holds: a dot product over head_dim per (row, key).
* **Softmax** in two passes: the row's maximum over the keys it may see (a max is exact
  in any order), then `e^(s - max)`, exactly 0 where it may not see (e^-inf).
* **Values** and the softmax denominator in one more product, over V with a column of
  ones appended: key j adds `w_j v_j` into lane j mod 16, and the keys a row may not see
  add exact zeros, so a row that sees 40 keys gets the same sum inside a 1,000-key prompt
  as alone (key j of a sequence is always column j: slots start at its position 0). Then
  numerator / denominator.

A prompt's rows go QUERY_CHUNK at a time, each chunk against the keys up to its last
row, so the (rows x keys) scores stay small. `invariant_cpu_attention` is the same
contract through the native prompt kernel (kvlab.kernels.cpu_prefill), decodes included.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvlab.cache.pool import KVPool
from kvlab.model.metadata import AttentionGroup, AttentionMetadata

QUERY_CHUNK = 256  # prompt rows per score matrix


def invariant_attention(
    q: torch.Tensor, layer: int, pool: KVPool, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """pooled_attention's contract, each row computed as the module docstring says.

    q: (T, heads, head_dim), rows packed sequence by sequence -> (T, heads, head_dim).
    """
    out = torch.empty_like(q)
    for group in meta.groups:
        out[group.rows] = group_invariant(q[group.rows], layer, pool, group, scale)
    return out


def group_invariant(
    q: torch.Tensor, layer: int, pool: KVPool, group: AttentionGroup, scale: float
) -> torch.Tensor:
    """One group: q (G * Q, heads, head_dim) -> the same shape."""
    k, v = pool.gather(layer, group.slots)  # (G, S, kv_heads, head_dim)
    count, width = group.slots.shape
    heads, head_dim = q.shape[1:]
    grouped = q.view(count, -1, heads, head_dim)  # (G, Q, heads, head_dim)
    queries = grouped.shape[1]
    if group.mask is None:  # a whole prompt: row i sees keys 0 .. i
        keys = torch.arange(width, device=q.device)
        visible = (keys[None, :] <= keys[:, None])[None]  # (1, Q, S)
    else:
        visible = group.mask[:, 0]  # (G | 1, Q, S)
    out = torch.empty_like(grouped)
    for start in range(0, queries, QUERY_CHUNK):
        stop = min(queries, start + QUERY_CHUNK)
        seen = width - queries + stop  # the chunk's last row sees keys [0, seen)
        out[:, start:stop] = attend(
            grouped[:, start:stop], k[:, :seen], v[:, :seen], visible[:, start:stop, :seen], scale
        )
    return out.view_as(q)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float
) -> torch.Tensor:
    """q (G, n, heads, d); k, v (G, S, kv_heads, d); visible (G | 1, n, S) bool
    -> (G, n, heads, d) in q's dtype, computed in fp32."""
    from kvlab.kernels.cpu_invariant import invariant_bmm, invariant_exp

    count, n, heads, d = q.shape
    width, kv_heads = k.shape[1:3]
    dtype, g = q.dtype, heads // kv_heads
    # (G * kv_heads, n * g, d): row i * g + r is query row i, head kv_head * g + r
    q = q.float().reshape(count, n, kv_heads, g, d).permute(0, 2, 1, 3, 4)
    q = q.reshape(count * kv_heads, n * g, d)
    keys = k.float().permute(0, 2, 1, 3).reshape(count * kv_heads, width, d)
    scores = invariant_bmm(q, keys).mul_(scale).view(count, kv_heads, n * g, width)
    see = visible.repeat_interleave(g, dim=1)[:, None]  # (G | 1, 1, n * g, S)
    scores.masked_fill_(~see, float("-inf"))
    top = scores.amax(dim=-1, keepdim=True)  # (G, kv_heads, n * g, 1), exact
    top.masked_fill_(top == float("-inf"), 0.0)  # a row that sees nothing: no -inf - -inf
    weights = invariant_exp(scores.sub_(top))  # e^(s - max), 0 where not seen
    ones = torch.ones(*v.shape[:3], 1, dtype=torch.float32, device=v.device)
    values = torch.cat([v.float(), ones], dim=-1)  # (G, S, kv_heads, d + 1): the ones sum w
    values = values.permute(0, 2, 3, 1).reshape(count * kv_heads, d + 1, width)
    both = invariant_bmm(weights.view(count * kv_heads, n * g, width), values)
    out = both[..., :d] / both[..., d:]  # (G * kv_heads, n * g, d)
    out = out.view(count, kv_heads, n, g, d).permute(0, 2, 1, 3, 4)
    return out.reshape(count, n, heads, d).to(dtype)


def invariant_cpu_attention(
    q: torch.Tensor, layer: int, pool: KVPool, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """invariant_attention's contract through the native prompt kernel, the whole step in
    one call (kvlab.kernels.cpu_paged_prefill_attention_batch).

    The kernel computes a row in lanes of its own over key chunks that start at position
    0, so a row's bits depend on its position and keys only: a decode is a one-row prompt.
    The pool's codec must be one of kvlab.kernels.dispatch.CPU_CODECS and the native
    kernels built, head_dim a multiple of 16 (kvlab.model.invariant.kernel_runs).
    """
    from kvlab.kernels import cpu_paged_prefill_attention_batch
    from kvlab.model.kernel_args import pool_layer

    stored = pool_layer(pool, layer)
    starts = F.pad(meta.last_token_index + 1, (1, 0))  # (B + 1,): each sequence's first row
    return cpu_paged_prefill_attention_batch(
        q, stored["k_cache"], stored["v_cache"], meta.context_slots, starts,
        meta.context_lens, scale,
    )  # fmt: skip
