"""The engine's side of speculative decoding: room, drafts, verification, rollback.

One step, for each decoding sequence (pending token at position p = num_computed):

1. `plan`: its room, k' = min(k, tokens it may still emit - 1, max_model_len - p - 2, the
   codec's limit). A proposer that drafts from tokens alone drafts now; the scheduler
   then schedules 1 + len(drafts) tokens (1 + k' for a proposer that drafts in slots)
   and secures their blocks, preempting as for any other growth.
2. `draft`: a proposer that drafts in slots runs now; the batch's token counts are set to
   1 + len(drafts); `leave_out` drops the drafts of running sequences the step leaves out.
3. The forward computes positions p .. p + d for the row, beside every other row.
4. `verify`: the tokens it emits (accepted drafts + one); after the engine appends them,
   `rollback` rewinds num_computed to the new length - 1 and the cache returns the
   blocks past it (`KVCache.rewind`), rolling the codec's state back too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvlab.cache.base import KVCache
from kvlab.config import SpeculativeConfig
from kvlab.sequence import Sequence
from kvlab.speculative.registry import PROPOSERS
from kvlab.speculative.verify import accept


@dataclass
class SpecEvent:
    """One verified row, for block-table animations (kept when record_block_map is on)."""

    step: int  # the engine step (1-based) it ran in
    request_id: int
    position: int  # of the pending token; drafts follow at position + 1, ...
    drafts: list[int]
    accepted: int  # drafts accepted
    table: list[int]  # block table while verifying (drafts' blocks included)
    kept: list[int] = field(default_factory=list)  # block table after the rollback


@dataclass
class SpecStats:
    """What speculation did, summed over the engine's life (`Engine.spec_stats()`)."""

    verify_rows: int = 0  # decode rows that carried drafts (one target forward each)
    decode_rows: int = 0  # every decode row, with or without drafts
    drafted: int = 0  # draft tokens computed by the target
    accepted: int = 0  # of those, accepted
    emitted: int = 0  # tokens decode rows emitted (accepted drafts + one each)
    rolled_back_blocks: int = 0  # blocks that held only rejected drafts, returned
    accept_lengths: list[int] = field(default_factory=list)  # per verify row

    @property
    def rejected(self) -> int:
        """Draft tokens whose K/V briefly held a slot, then were rolled back."""
        return self.drafted - self.accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_forward(self) -> float:
        """Output tokens per target forward, per decoding sequence (1.0 without drafts)."""
        return self.emitted / self.decode_rows if self.decode_rows else 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "decode_rows": self.decode_rows,
            "verify_rows": self.verify_rows,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "rejected": self.rejected,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "tokens_per_forward": round(self.tokens_per_forward, 4),
            "rolled_back_blocks": self.rolled_back_blocks,
        }


class Speculator:
    """Drafts for decoding sequences, verifies them and rolls the cache back."""

    def __init__(
        self,
        config: SpeculativeConfig,
        runner,
        cache: KVCache,
        max_model_len: int,
        record: bool = False,
    ):
        self.config, self.cache, self.max_model_len = config, cache, max_model_len
        self.proposer = PROPOSERS[config.method](config, runner, cache)
        self.stats = SpecStats()
        self.record = record  # keep a SpecEvent per verified row in `events`
        self.events: list[SpecEvent] = []
        self._step = 0

    # --- before and after scheduling ------------------------------------------------
    def room(self, seq: Sequence) -> int:
        """Drafts `seq` may carry this step (0: decode as usual)."""
        emit_left = seq.params.max_new_tokens - len(seq.output_ids) - 1
        length_left = self.max_model_len - seq.num_tokens - 1
        codec = self.cache.pool.codec.draft_room(seq.num_computed)
        return max(0, min(self.config.num_speculative_tokens, emit_left, length_left, codec))

    def plan(self, running: list[Sequence]) -> None:
        """Set each running sequence's `spec_room` (and drafts, for token-only proposers)."""
        self._step += 1
        decoding = [s for s in running if s.num_pending == 1 and s.output_ids]
        for seq in running:
            seq.spec_room, seq.draft_ids = 0, []
        room = [self.room(s) for s in decoding]
        if self.proposer.drafts_in_slots:
            for seq, k in zip(decoding, room):
                seq.spec_room = k
            return
        for seq, drafts in zip(decoding, self.proposer.propose(decoding, room)):
            seq.draft_ids, seq.spec_room = drafts, len(drafts)

    def leave_out(self, batch, running: list[Sequence]) -> None:
        """Running sequences the step leaves out drop the drafts `plan` gave them."""
        scheduled = {id(seq) for seq in batch.seqs}
        for seq in running:
            if id(seq) not in scheduled:
                seq.draft_ids, seq.spec_room = [], 0

    def draft(self, batch) -> None:
        """Fill the drafts of the batch's decode rows and fit them to the tokens each row
        was given (a row the budget cut to one token drops its drafts)."""
        rows = [i for i, (s, n) in enumerate(batch) if s.num_pending == 1]
        slotted = [i for i in rows if batch.num_new_tokens[i] > 1]
        if self.proposer.drafts_in_slots and slotted:
            seqs = [batch.seqs[i] for i in slotted]
            drafts = self.proposer.propose(seqs, [batch.num_new_tokens[i] - 1 for i in slotted])
            for seq, d in zip(seqs, drafts):
                seq.draft_ids = d
        for i in rows:
            seq = batch.seqs[i]
            seq.draft_ids = seq.draft_ids[: batch.num_new_tokens[i] - 1]
            batch.num_new_tokens[i] = 1 + len(seq.draft_ids)

    # --- after the forward --------------------------------------------------------------
    def verify(self, seq: Sequence, logits: torch.Tensor) -> list[int]:
        """logits: (1 + len(drafts), vocab) -> the tokens the row emits."""
        tokens = accept(logits, seq.draft_ids, seq.params, seq.generator)
        self.stats.verify_rows += 1
        self.stats.drafted += len(seq.draft_ids)
        self.stats.accepted += len(tokens) - 1
        self.stats.accept_lengths.append(len(tokens) - 1)
        if self.record:
            table = list(self.cache.block_table(seq))
            position = seq.num_computed - 1 - len(seq.draft_ids)  # num_computed includes them
            self.events.append(SpecEvent(self._step, seq.request_id, position,
                                         list(seq.draft_ids), len(tokens) - 1, table))  # fmt: skip
        return tokens

    def count_decode(self, emitted: int) -> None:
        self.stats.decode_rows += 1
        self.stats.emitted += emitted

    def rollback(self, seq: Sequence) -> None:
        """After the emitted tokens are appended: keep the K/V of all but the last token
        (which the next step computes) and return the blocks past them."""
        self.stats.rolled_back_blocks += self.cache.rewind(seq, seq.num_tokens - 1)
        if self.record and self.events and self.events[-1].request_id == seq.request_id:
            self.events[-1].kept = list(self.cache.block_table(seq))
        seq.draft_ids, seq.spec_room = [], 0
