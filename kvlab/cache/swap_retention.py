"""The paged cache's block moves besides growth: swap preemption, speculative rollback, and
retention.

- swap: a victim's stored KV is read to host memory and its blocks freed; it comes back
  into fresh blocks when it fits (with tiers, the swap space is the host tier's memory).
- rollback: blocks past a sequence's kept tokens held only rejected drafts (never
  published, never shared): they go straight back to the free list.
- retention (`retention`, kvlab.cache.retention): a policy may drop whole blocks of a
  running sequence after each step; the table keeps a `DROPPED` entry in their place,
  the block goes back to the allocator, and only the leading run of kept blocks is ever
  indexed for prefix sharing.
"""

from __future__ import annotations

from kvlab.cache.codecs import StoredKV
from kvlab.cache.retention import DROPPED
from kvlab.integrity import require
from kvlab.sequence import Sequence
from kvlab.units import ceil_div


class SwapAndRetention:
    """PagedCache's swap, rollback and retention (a mixin: it reads the cache's tables)."""

    # --- swapping --------------------------------------------------------------------
    def swap_out(self, seq: Sequence) -> StoredKV:
        saved = self.pool.read(self.position_slots(seq, 0, seq.num_computed))
        self.free(seq)
        if self.connector is not None:  # tiers: the swap space is the host tier's memory
            self.connector.swap_out(seq, saved)
        return saved

    def allocate_computed(self, seq: Sequence, alone: bool = False) -> list[int] | None:
        """A block table for `seq`'s `num_computed` tokens and its next one, whose KV is
        written in from outside (swap-in restores it, a KV connector loads it:
        kvlab.disagg) -> the table; or None, and nothing taken, when the blocks would
        endanger running sequences (`alone`: none is running). Deciding and taking are one
        call, as in `allocate_slots`."""
        need = ceil_div(seq.num_computed + 1, self.block_size)
        room = self.allocator.num_available - self.admission.promised()
        if need > room - self.admission.headroom(alone):
            return None
        self.tables[seq.request_id] = []
        self.sequences[seq.request_id] = seq
        self.ensure_capacity(seq, seq.num_computed)
        return self.tables[seq.request_id]

    def swap_in(self, seq: Sequence, saved: StoredKV) -> None:
        """Restore swapped-out KV into the blocks `allocate_computed` gave `seq`."""
        self.pool.restore(self.position_slots(seq, 0, seq.num_computed), saved)
        self.drop_swapped(seq)

    def drop_swapped(self, seq: Sequence) -> None:
        if self.connector is not None:
            self.connector.swap_done(seq)

    # --- speculative rollback ----------------------------------------------------------
    def _trim(self, seq: Sequence) -> list[int]:
        """Speculative rollback: blocks past the kept tokens held only rejected drafts
        (never published, never shared): they go straight back to the free list."""
        table = self.tables[seq.request_id]
        keep = ceil_div(seq.num_computed, self.block_size)
        dropped = table[keep:]
        for block in dropped:
            require(
                self.allocator.ref_counts[block] == 1 and not self._indexed(block),
                f"block {block} past request {seq.request_id}'s tokens is shared or indexed",
            )
        del table[keep:]
        return [b for b in dropped if self.allocator.decref(b)]

    # --- retention (kvlab.cache.retention) -------------------------------------------
    def _take_block(self) -> int:
        block = self.allocator.allocate()
        self.retention.on_allocate(block)
        return block

    def retain(self, seq: Sequence) -> None:
        """After a step: drop the blocks of `seq` its retention policy no longer keeps. A
        block no other table holds leaves the prefix index and goes back to the free list."""
        table = self.tables[seq.request_id]
        freed = []
        for i in self.retention.drop(table, seq.num_computed):
            block, table[i] = table[i], DROPPED
            if self.allocator.ref_counts[block] == 1 and self._indexed(block):
                self._forget(block)
            if self.allocator.decref(block):
                freed.append(block)
            self.dropped_blocks += 1
        if self.poison_freed and freed:
            self.pool.poison(self.block_slots(freed))
