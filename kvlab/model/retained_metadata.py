"""Attention metadata for block tables in which a retention policy dropped blocks.

`build_attention_metadata` hands over to `build_retained_metadata` when a table holds a
`DROPPED` entry (kvlab.cache.retention). The context of a sequence is then only its
kept positions: context_slots (B, S) lists the slots of kept positions in order
(S = the most kept by any sequence), context_lens counts them, and the masks compare
original positions, so a query at position p sees every kept position <= p. Positions
(RoPE) stay the original ones.
"""

from __future__ import annotations

import torch

from kvlab.cache.retention.base import DROPPED
from kvlab.model.metadata import AttentionGroup, AttentionMetadata, _similar_lengths


def _kept(table: list[int], context: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, slots) of the kept positions in [0, context), each (K,) int64."""
    blocks = torch.tensor(table, dtype=torch.long)
    pos = torch.arange(context)
    physical = blocks[pos // block_size]
    keep = physical != DROPPED
    return pos[keep], physical[keep] * block_size + pos[keep] % block_size


def build_retained_metadata(
    starts: list[int],
    query_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """Metadata for new tokens at positions [start, start + query_len) whose context is
    the kept blocks of each table (see the module docstring)."""
    batch = len(starts)
    start = torch.tensor(starts, dtype=torch.long)
    qlen = torch.tensor(query_lens, dtype=torch.long)
    row = torch.arange(int(qlen.max()))
    query_valid = row[None, :] < qlen[:, None]  # (B, Q)
    query_pos = torch.where(query_valid, start[:, None] + row[None, :], -1)

    kept = [_kept(t, s + n, block_size) for t, s, n in zip(block_tables, starts, query_lens)]
    lens = [len(positions) for positions, _ in kept]
    width = max(lens)
    context_slots = torch.empty(batch, width, dtype=torch.long)  # (B, S)
    key_pos = torch.full((batch, width), -1, dtype=torch.long)  # (B, S), -1 = padding
    for b, (positions, slots) in enumerate(kept):
        context_slots[b] = slots[0]  # padding reads the sequence's own first kept slot
        context_slots[b, : lens[b]] = slots
        key_pos[b, : lens[b]] = positions
    # New tokens are the last query_len kept positions of each sequence.
    slot_mapping = torch.cat([slots[len(slots) - n :] for (_, slots), n in zip(kept, query_lens)])

    first_rows = [0]
    for n in query_lens:
        first_rows.append(first_rows[-1] + n)
    groups = []
    decodes = [b for b, n in enumerate(query_lens) if n == 1]
    for members in _similar_lengths(decodes, lens):
        size = lens[members[0]]
        kept_lens = torch.tensor([lens[b] for b in members])  # (G,)
        visible = torch.arange(size)[None, :] < kept_lens[:, None]
        groups.append(
            AttentionGroup(
                rows=torch.tensor([first_rows[b] for b in members], device=device),
                slots=context_slots[members, :size].to(device),
                mask=visible[:, None, None, :].to(device),  # (G, 1, 1, S)
                lens=kept_lens.to(device),
            )
        )
    for b, n in enumerate(query_lens):
        if n == 1:
            continue
        keys = key_pos[b, : lens[b]]
        mask = keys[None, :] <= query_pos[b, :n, None]  # (Q, S) by original positions
        groups.append(
            AttentionGroup(
                rows=slice(first_rows[b], first_rows[b] + n),
                slots=context_slots[b : b + 1, : lens[b]].to(device),
                mask=mask[None, None].to(device),  # (1, 1, Q, S)
            )
        )
    return AttentionMetadata(
        positions=query_pos[query_valid].to(device),
        slot_mapping=slot_mapping.to(device),
        context_slots=context_slots.to(device),
        context_lens=torch.tensor(lens, dtype=torch.long).to(device),
        query_pos=query_pos.to(device),
        query_valid=query_valid.to(device),
        last_token_index=(qlen.cumsum(0) - 1).to(device),
        groups=groups,
    )
