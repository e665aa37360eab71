"""Per-step attention metadata: plain int tensors built once and read by every layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Where each packed token sits and where its sequence's K/V live in the pool.

    B sequences run this step; sequence b contributes query_lens[b] new tokens (its whole
    prompt in prefill, 1 token in decode) packed into T = sum(query_lens) rows.
    """

    positions: torch.Tensor  # (T,) absolute position of each new token
    slot_mapping: torch.Tensor  # (T,) pool slot each new token's K/V is written to
    context_slots: torch.Tensor  # (B, S) pool slots of each sequence's context, padded
    #   with the sequence's own first slot, so a padded read never touches foreign state
    context_lens: torch.Tensor  # (B,) context tokens, new ones included
    query_pos: torch.Tensor  # (B, Q) absolute position of each query row, -1 = padding
    query_valid: torch.Tensor  # (B, Q) True where the row is a real token
    last_token_index: torch.Tensor  # (B,) row in T of each sequence's last new token

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]


def build_attention_metadata(
    starts: list[int],
    query_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """Metadata for sequences whose new tokens occupy positions [start, start + query_len).

    A position p of sequence b lives in slot table[b][p // block_size] * block_size
    + p % block_size, for every cache variant.
    """
    batch = len(starts)
    start = torch.tensor(starts, dtype=torch.long)
    qlen = torch.tensor(query_lens, dtype=torch.long)
    ctx = start + qlen
    q_max, s_max = int(qlen.max()), int(ctx.max())

    row = torch.arange(q_max)
    query_valid = row[None, :] < qlen[:, None]  # (B, Q)
    query_pos = torch.where(query_valid, start[:, None] + row[None, :], -1)

    width = max(len(t) for t in block_tables)
    tables = torch.zeros(batch, width, dtype=torch.long)  # (B, max_blocks), padded with 0
    for b, table in enumerate(block_tables):
        tables[b, : len(table)] = torch.tensor(table, dtype=torch.long)
    pos = torch.arange(s_max)
    block_index = (pos // block_size).clamp(max=width - 1).expand(batch, s_max)
    context_slots = tables.gather(1, block_index) * block_size + pos % block_size  # (B, S)
    # Past a sequence's end, point at its own first slot: always written, never NaN, and
    # masked out of the softmax anyway.
    context_slots = torch.where(pos[None, :] < ctx[:, None], context_slots, context_slots[:, :1])

    slot_mapping = context_slots.gather(1, query_pos.clamp(min=0))[query_valid]
    return AttentionMetadata(
        positions=query_pos[query_valid].to(device),
        slot_mapping=slot_mapping.to(device),
        context_slots=context_slots.to(device),
        context_lens=ctx.to(device),
        query_pos=query_pos.to(device),
        query_valid=query_valid.to(device),
        last_token_index=(qlen.cumsum(0) - 1).to(device),
    )
