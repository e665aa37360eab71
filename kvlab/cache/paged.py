"""The paged cache: KV in fixed-size blocks, found through a per-sequence block table.

A sequence takes a new block only when its last block is full, so at most
block_size - 1 slots per sequence are ever unused (the tail of its last block).

Admission (until the scheduler can preempt): a request is admitted only if the blocks it
could ever need, ceil(min(prompt + max_new_tokens, max_model_len) / block_size), fit
beside what running sequences could still claim. Blocks are taken lazily, so memory is
only *held* as tokens arrive, but a running sequence can never run out of blocks.

With a prefix index (`prefix_caching="hash" | "radix"`), admission first looks the
prompt up: matched blocks join the new table by reference (their tokens are not computed
again), and a finished sequence's blocks stay cached for later requests until evicted.
A block referenced by several tables is never written: the first write to it copies it
(copy-on-write).
"""

from __future__ import annotations

import torch

from kvlab.cache.base import KVCache
from kvlab.cache.block_allocator import BlockAllocator
from kvlab.cache.pool import KVPool
from kvlab.cache.prefix_index import PrefixIndex, PrefixMatch
from kvlab.sequence import Sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)  # ceil division


class PagedCache(KVCache):
    name = "paged"

    def __init__(
        self,
        pool: KVPool,
        block_size: int,
        max_model_len: int,
        poison_freed: bool = False,
        prefix_index: PrefixIndex | None = None,
        watermark: float | None = None,
    ):
        super().__init__(pool, block_size, max_model_len, poison_freed)
        self.index = prefix_index
        # None: reserve admission (worst case promised, never preempts). Otherwise the
        # fraction of blocks that must stay free after admitting a prompt.
        self.watermark_blocks = None if watermark is None else int(watermark * self.num_blocks)
        self.allocator = BlockAllocator(self.num_blocks, on_evict=self._forget)
        self.tables: dict[int, list[int]] = {}  # request id -> block table
        self.promised: dict[int, int] = {}  # request id -> blocks it may still claim
        self.copied_blocks = 0  # copy-on-write copies made

    # --- admission -----------------------------------------------------------------
    def worst_case_blocks(self, seq: Sequence) -> int:
        tokens = min(len(seq.prompt_ids) + seq.params.max_new_tokens, self.max_model_len)
        return blocks_for(tokens, self.block_size)

    def check_fits(self, seq: Sequence) -> None:
        need = self.worst_case_blocks(seq)
        if need > self.num_blocks:
            raise ValueError(
                f"request needs {need} blocks of {self.block_size} tokens (prompt "
                f"{len(seq.prompt_ids)} + max_new_tokens {seq.params.max_new_tokens}) but the "
                f"KV budget holds only {self.num_blocks} blocks"
            )

    def _lookup(self, seq: Sequence) -> PrefixMatch:
        """Cached prefix of the prompt, leaving at least its last token to compute."""
        if self.index is None or seq.num_computed:
            return PrefixMatch([])
        match = self.index.match(seq.prompt_ids, seq.salt)
        limit = len(seq.prompt_ids) - 1  # the last prompt token must run to give logits
        full = match.blocks[: limit // self.block_size]
        if len(full) < len(match.blocks) or match.partial_block is None:
            return PrefixMatch(full)
        partial = min(match.partial_tokens, limit - len(full) * self.block_size)
        return PrefixMatch(full, match.partial_block, partial) if partial else PrefixMatch(full)

    def can_admit(self, seq: Sequence) -> bool:
        match = self._lookup(seq)
        revived = sum(1 for b in match.blocks if b in self.allocator.cached)
        available = self.allocator.num_available - revived - sum(self.promised.values())
        if self.watermark_blocks is None:
            return self.worst_case_blocks(seq) - len(match.blocks) <= available
        prompt = blocks_for(seq.num_tokens, self.block_size) - len(match.blocks)
        return prompt <= available - self.watermark_blocks

    def _allocate(self, seq: Sequence) -> None:
        match = self._lookup(seq)
        table = []
        for block in match.blocks:
            self.allocator.incref(block)
            table.append(block)
        self.tables[seq.request_id] = table
        self.promised[seq.request_id] = self._promise(seq, table)
        hit = len(table) * self.block_size
        if match.partial_block is not None:
            # Token-granular hit (radix): copy the matching slots instead of recomputing.
            source = match.partial_block
            self.allocator.incref(source)  # keep it from being evicted by our allocation
            self._append_block(seq)
            self._copy_slots(source, table[-1], match.partial_tokens)
            self.allocator.decref(source, keep_cached=source in self.index)
            hit += match.partial_tokens
        seq.num_computed = seq.prefix_hit_tokens = hit
        if self.watermark_blocks is not None:
            # Take the prompt's blocks now, so the next admission in the same step sees
            # them gone (watermark admission makes no promises to count instead).
            self.ensure_capacity(seq, seq.num_tokens)

    def _promise(self, seq: Sequence, table: list[int]) -> int:
        """Blocks set aside for `seq` to grow into (reserve admission only)."""
        if self.watermark_blocks is not None:
            return 0
        return max(0, self.worst_case_blocks(seq) - len(table))

    def _spend_promise(self, request_id: int) -> None:
        self.promised[request_id] = max(0, self.promised[request_id] - 1)

    # --- growth --------------------------------------------------------------------
    def _append_block(self, seq: Sequence) -> None:
        self.tables[seq.request_id].append(self.allocator.allocate())
        self._spend_promise(seq.request_id)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        table = self.tables[seq.request_id]
        first = seq.num_computed // self.block_size
        copy = first < len(table) and self.allocator.ref_counts[table[first]] > 1
        grow = max(0, blocks_for(num_tokens, self.block_size) - len(table))
        return grow + copy - self.promised[seq.request_id]

    def ensure_capacity(self, seq: Sequence, num_tokens: int) -> None:
        table = self.tables[seq.request_id]
        first = seq.num_computed // self.block_size  # the block the next write lands in
        if first < len(table) and self.allocator.ref_counts[table[first]] > 1:
            self._copy_on_write(seq, first)
        while len(table) * self.block_size < num_tokens:
            self._append_block(seq)

    def _copy_on_write(self, seq: Sequence, index: int) -> None:
        table = self.tables[seq.request_id]
        shared = table[index]
        fresh = self.allocator.allocate()
        self._spend_promise(seq.request_id)
        self._copy_slots(shared, fresh, seq.num_computed - index * self.block_size)
        table[index] = fresh
        self.allocator.decref(shared, keep_cached=self._indexed(shared))
        self.copied_blocks += 1

    def _copy_slots(self, source: int, target: int, count: int) -> None:
        offsets = torch.arange(count, device=self.pool.device)
        self.pool.copy(source * self.block_size + offsets, target * self.block_size + offsets)

    # --- sharing -------------------------------------------------------------------
    def publish(self, seq: Sequence) -> None:
        """Index the full blocks of what `seq` has computed, for later requests to reuse."""
        if self.index is not None:
            tokens = seq.token_ids[: seq.num_computed]
            self.index.insert(tokens, self.tables[seq.request_id], seq.salt)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares all of `parent`'s blocks (n > 1 sampling); writes copy on demand."""
        table = list(self.tables[parent.request_id])
        for block in table:
            self.allocator.incref(block)
        self.tables[child.request_id] = table
        self.sequences[child.request_id] = child
        # Its own growth, plus one copy of the shared partial last block.
        self.promised[child.request_id] = self._promise(child, table) + (
            self.watermark_blocks is None
        )

    def fork_blocks_needed(self, seq: Sequence, samples: int) -> int:
        """Extra blocks `samples - 1` forks of `seq` may claim beyond its own promise."""
        shared_full = len(seq.prompt_ids) // self.block_size
        return (samples - 1) * (self.worst_case_blocks(seq) - shared_full + 1)

    def _indexed(self, block: int) -> bool:
        return self.index is not None and block in self.index

    def _forget(self, block: int) -> None:
        """An evicted cached block: drop it from the index, and free what hung below it."""
        for orphan in self.index.remove(block):
            if orphan in self.allocator.cached:
                self.allocator.uncache(orphan)

    # --- swapping --------------------------------------------------------------------
    def swap_out(self, seq: Sequence) -> list[tuple[torch.Tensor, torch.Tensor]]:
        saved = self.pool.read(self._slots(seq, seq.num_computed))
        self.free(seq)
        return saved

    def can_swap_in(self, seq: Sequence) -> bool:
        need = blocks_for(seq.num_computed + 1, self.block_size)
        margin = self.watermark_blocks or 0
        return need <= self.allocator.num_available - sum(self.promised.values()) - margin

    def swap_in(self, seq: Sequence, saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.tables[seq.request_id] = []
        self.promised[seq.request_id] = 0
        self.sequences[seq.request_id] = seq
        self.ensure_capacity(seq, seq.num_computed)
        self.promised[seq.request_id] = self._promise(seq, self.tables[seq.request_id])
        self.pool.restore(self._slots(seq, seq.num_computed), saved)

    def _slots(self, seq: Sequence, num_tokens: int) -> torch.Tensor:
        """Pool slots of positions [0, num_tokens) of `seq`."""
        table = torch.tensor(self.tables[seq.request_id], dtype=torch.long)
        positions = torch.arange(num_tokens)
        slots = table[positions // self.block_size] * self.block_size + positions % self.block_size
        return slots.to(self.pool.device)

    # --- release -------------------------------------------------------------------
    def _release(self, seq: Sequence) -> list[int]:
        del self.promised[seq.request_id]
        table = self.tables.pop(seq.request_id)
        if self.index is not None:
            tokens = seq.token_ids[: seq.num_computed]
            sole_owner = bool(table) and self.allocator.ref_counts[table[-1]] == 1
            self.index.insert(tokens, table, seq.salt, partial=sole_owner)
        # Tail blocks first: they become the least recently used, so evicted first.
        return [b for b in reversed(table) if self.allocator.decref(b, self._indexed(b))]

    # --- accounting ----------------------------------------------------------------
    def block_table(self, seq: Sequence) -> list[int]:
        return self.tables[seq.request_id]

    def num_free_blocks(self) -> int:
        return self.allocator.num_available

    def reserved_slots(self) -> int:
        return self.allocator.num_used * self.block_size

    def live_tokens(self) -> int:
        """Tokens stored in referenced blocks, each shared block counted once."""
        filled: dict[int, int] = {}
        for request_id, seq in self.sequences.items():
            for i, block in enumerate(self.tables[request_id]):
                tokens = min(self.block_size, seq.num_computed - i * self.block_size)
                filled[block] = max(filled.get(block, 0), tokens)
        return sum(filled.values())

    def block_owners(self) -> list[int]:
        """Owner request id per block; -1 free or cached, -2 shared by several requests."""
        owners = [-1] * self.num_blocks
        for request_id, table in self.tables.items():
            for block in table:
                owners[block] = request_id if owners[block] == -1 else -2
        return owners

    def check_integrity(self) -> None:
        self.allocator.check_integrity()
        counts = [0] * self.num_blocks
        salts: dict[int, set] = {}
        for request_id, table in self.tables.items():
            for block in table:
                counts[block] += 1
                salts.setdefault(block, set()).add(self.sequences[request_id].salt)
        assert counts == self.allocator.ref_counts, "reference counts != table references"
        assert all(len(s) == 1 for s in salts.values()), "a block is shared across salts"
        assert set(self.tables) == set(self.sequences), "block tables != admitted sequences"
        for block in self.allocator.cached:
            assert self._indexed(block), f"cached block {block} is not in the prefix index"
        for request_id, seq in self.sequences.items():
            held = len(self.tables[request_id]) * self.block_size
            assert seq.num_computed <= held, f"request {request_id} has tokens outside its blocks"
            assert self.promised[request_id] >= 0, f"request {request_id} overdrew its promise"
        assert sum(self.promised.values()) <= self.allocator.num_available, (
            "promised > available blocks"
        )
