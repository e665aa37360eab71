"""Batch-invariant attention: each query row's result, bit for bit, whatever else runs.

`pooled_attention` hands each group to scaled_dot_product_attention, whose CPU kernel
blocks the work by the number of query rows (a whole prompt, a chunk, one decode) and
reads a decode group padded to its longest member: the same row comes out with other
rounding when its sequence is chunked, found in the prefix cache or batched with others.
Here every row is computed the same way wherever it sits:

* **Scores** `q . k * scale` for the row's g = heads / kv_heads query heads against every
  key its group holds, as one matmul per (sequence, kv head) whose row count is padded
  to a multiple of ROW_TILE and whose key count is padded to one too. On the CPU this
  keeps MKL's sgemm on one code path: below 16 rows or columns it takes others (gemv
  for one row), and a row's bits then depend on how many rows came with it
  (kvlab.experiments.determinism.matmul_rows measures it).
* **Softmax** in two passes: the row's maximum over the keys it may see (a max is exact
  in any order), then `e^(s - max)`, 0 where it may not see.
* **Values** and the softmax denominator in one more matmul, over V with a column of
  ones appended: key j adds `w_j v_j` in MKL's order over the keys, and the keys a row
  may not see add exact zeros, so a row that sees 40 keys gets the same sum inside a
  1,000-key prompt as alone. Then numerator / denominator.

A prompt's rows go QUERY_CHUNK at a time, each chunk against the keys up to its last
row, so the (rows x keys) scores stay small. `invariant_cpu_attention` is the same
contract through the native prompt kernel (kvlab.kernels.cpu_prefill), decodes included.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvlab.cache.pool import KVPool
from kvlab.model.metadata import AttentionGroup, AttentionMetadata

ROW_TILE = 16  # rows and columns of every matmul are padded to a multiple of this
KEY_BLOCK = 64  # keys per matmul: every product has the same reduction length
QUERY_CHUNK = 256  # prompt rows per score matrix


def padded(n: int) -> int:
    """n rounded up to a multiple of ROW_TILE (at least ROW_TILE)."""
    return max(ROW_TILE, -(-n // ROW_TILE) * ROW_TILE)


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
    count, n, heads, d = q.shape
    width, kv_heads = k.shape[1:3]
    dtype, g = q.dtype, heads // kv_heads
    rows, rows_pad = n * g, padded(n * g)
    blocks = -(-width // KEY_BLOCK)
    cols = blocks * KEY_BLOCK
    # (G, kv_heads, 1, R, d): row i * g + r is query row i, head kv_head * g + r
    q = q.float().reshape(count, n, kv_heads, g, d).permute(0, 2, 1, 3, 4)
    q = F.pad(q.reshape(count, kv_heads, rows, d), (0, 0, 0, rows_pad - rows))[:, :, None]
    k = F.pad(k.float(), (0, 0, 0, 0, 0, cols - width))  # (G, C, kv_heads, d)
    k = k.view(count, blocks, KEY_BLOCK, kv_heads, d).permute(0, 3, 1, 4, 2)  # (G, kvh, B, d, K)
    scores = torch.matmul(q, k).mul_(scale)  # (G, kv_heads, B, R, K)
    see = visible.repeat_interleave(g, dim=1)  # (G | 1, n * g, S)
    see = F.pad(see, (0, cols - width, 0, rows_pad - rows))  # (G | 1, R, C)
    see = see.view(see.shape[0], 1, rows_pad, blocks, KEY_BLOCK).transpose(2, 3)
    scores.masked_fill_(~see, float("-inf"))  # see: (G | 1, 1, B, R, K)
    top = scores.amax(dim=(2, 4), keepdim=True)  # (G, kv_heads, 1, R, 1), exact
    top.masked_fill_(top == float("-inf"), 0.0)  # padding rows: no NaN from -inf - -inf
    weights = scores.sub_(top).exp_()  # e^(s - max), 0 where not seen
    ones = torch.ones(*v.shape[:3], 1, dtype=torch.float32, device=v.device)
    v = torch.cat([v.float(), ones], dim=-1)  # (G, S, kv_heads, d + 1): the ones sum w
    v = F.pad(v, (0, padded(d + 1) - d - 1, 0, 0, 0, cols - width))
    v = v.view(count, blocks, KEY_BLOCK, kv_heads, -1).permute(0, 3, 1, 2, 4)  # (G,kvh,B,K,D)
    partial = torch.matmul(weights, v)  # (G, kv_heads, B, R, D): one sum per key block
    both = partial.cumsum(dim=2)[:, :, -1]  # the blocks in order (a scan adds left to right)
    out = both[..., :d] / both[..., d : d + 1]  # (G, kv_heads, R, d)
    out = out[:, :, :rows].reshape(count, kv_heads, n, g, d).permute(0, 2, 1, 3, 4)
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
