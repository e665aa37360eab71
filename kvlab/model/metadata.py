"""Per-step attention metadata: plain int tensors built once and read by every layer.

`build_attention_metadata` hands over to `build_retained_metadata` when a table holds a
`DROPPED` entry (kvlab.cache.retention). The context of a sequence is then only its
kept positions: context_slots (B, S) lists the slots of kept positions in order
(S = the most kept by any sequence), context_lens counts them, and the masks compare
original positions, so a query at position p sees every kept position <= p. Positions
(RoPE) stay the original ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvlab.cache.retention.base import DROPPED


@dataclass
class AttentionGroup:
    """Sequences the torch reference attends to in one call, without padding waste.

    Decoding sequences (one new token each) go into groups of similar context length:
    G sequences, Q = 1, S = the group's longest context (at most 25% padding). Each
    sequence with several new tokens (a prompt or a prompt chunk) is a group of its own:
    G = 1, Q = its new tokens, S = its context. Padding a 1,800-token prompt and 60
    decodes to one (B, Q, S) batch would cost 60 x 1,800 rows.
    """

    rows: torch.Tensor | slice  # the group's G * Q rows in T, sequence by sequence
    slots: torch.Tensor  # (G, S) pool slots of the context (padded as context_slots)
    mask: torch.Tensor | None  # (G, 1, Q, S) True = may attend; None = plain causal, Q == S
    lens: torch.Tensor | None = None  # (G,) int64 context of each decode; None for a prompt
    _shared: int | None = field(default=None, init=False, repr=False)  # shared_positions()

    def shared_positions(self) -> int:
        """Decodes: how many leading positions every sequence of the group reads from the
        same slots (a prefix they share: a cached system prompt or document), at most
        min(lens) - 1 so each keeps a position of its own; 0 for a prompt. Computed once."""
        if self._shared is None:
            self._shared = 0
            if self.lens is not None and len(self.lens) > 1:
                same = (self.slots == self.slots[:1]).all(dim=0)  # (S,)
                run = int(same.long().cumprod(dim=0).sum())
                self._shared = max(0, min(run, int(self.lens.min()) - 1))
        return self._shared


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
    groups: list[AttentionGroup]  # how the reference attention batches them (see below)
    window: int | None = None  # a sliding window's metadata (kvlab.model.pattern.windowed)
    # decode_group(), once built; not an __init__ field, so dataclasses.replace (a window's
    # metadata) starts its own
    _decodes: list = field(default_factory=list, init=False, repr=False)

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]

    def decode_group(self) -> AttentionGroup | None:
        """Every decode of the step (one new token each) in one group, in row order, or
        None when there is none: for kernels that read each sequence to its own length
        and so need no padding to batch them (the reference's groups split decodes by
        length). Each group's slots are padded with its last column to the widest. Built
        once."""
        if not self._decodes:
            parts = [group for group in self.groups if group.lens is not None]
            group = None
            if parts:
                width = max(g.slots.shape[1] for g in parts)
                pad = [g.slots[:, -1:].expand(-1, width - g.slots.shape[1]) for g in parts]
                slots = torch.cat([torch.cat([g.slots, p], dim=1) for g, p in zip(parts, pad)])
                rows = torch.cat([torch.as_tensor(g.rows) for g in parts])
                order = rows.argsort()
                lens = torch.cat([g.lens for g in parts])
                group = AttentionGroup(rows[order], slots[order], None, lens[order])
            self._decodes.append(group)
        return self._decodes[0]


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
    if any(DROPPED in table for table in block_tables):  # a retention policy dropped blocks
        return build_retained_metadata(starts, query_lens, block_tables, block_size, device)
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
    groups = _groups(query_lens, ctx.tolist(), context_slots, device)
    return AttentionMetadata(
        positions=query_pos[query_valid].to(device),
        slot_mapping=slot_mapping.to(device),
        context_slots=context_slots.to(device),
        context_lens=ctx.to(device),
        query_pos=query_pos.to(device),
        query_valid=query_valid.to(device),
        last_token_index=(qlen.cumsum(0) - 1).to(device),
        groups=groups,
    )


def _groups(
    query_lens: list[int], context_lens: list[int], context_slots: torch.Tensor, device
) -> list[AttentionGroup]:
    """Decoding sequences batched by similar context length, one group per prompt."""
    first_rows = [0]
    for n in query_lens:
        first_rows.append(first_rows[-1] + n)
    decodes = [b for b, n in enumerate(query_lens) if n == 1]
    groups = []
    for batch in _similar_lengths(decodes, context_lens):
        width = context_lens[batch[0]]  # the longest of the batch
        lens = torch.tensor([context_lens[b] for b in batch])
        visible = torch.arange(width)[None, :] < lens[:, None]  # (G, S)
        groups.append(
            AttentionGroup(
                rows=torch.tensor([first_rows[b] for b in batch], device=device),
                slots=context_slots[batch, :width].to(device),
                mask=visible[:, None, None, :].to(device),  # (G, 1, 1, S)
                lens=lens.to(device),
            )
        )
    for b, n in enumerate(query_lens):
        if n == 1:
            continue
        width = context_lens[b]
        mask = None  # a whole prompt: plain causal attention
        if n < width:  # new tokens after cached ones (prefix hit, later chunk)
            query_pos = torch.arange(width - n, width)
            mask = (torch.arange(width)[None, :] <= query_pos[:, None])[None, None].to(device)
        groups.append(
            AttentionGroup(
                rows=slice(first_rows[b], first_rows[b] + n),
                slots=context_slots[b : b + 1, :width].to(device),
                mask=mask,
            )
        )
    return groups


def _similar_lengths(
    seqs: list[int], context_lens: list[int], max_padding: float = 0.25
) -> list[list[int]]:
    """Split seqs, longest first, into runs whose padded size (count x longest) exceeds
    their real size (sum of lengths) by at most max_padding: decode attention reads
    every padded slot, and on CPU it is bound by those reads."""
    runs: list[list[int]] = []
    total = 0
    for b in sorted(seqs, key=lambda b: -context_lens[b]):
        if runs:
            run = runs[-1]
            padded = (len(run) + 1) * context_lens[run[0]]
            if padded <= (1 + max_padding) * (total + context_lens[b]):
                run.append(b)
                total += context_lens[b]
                continue
        runs.append([b])
        total = context_lens[b]
    return runs


# --- block tables in which a retention policy dropped blocks ---------------------------
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
