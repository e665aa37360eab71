"""The paged cache: KV in fixed-size blocks, found through a per-sequence block table.

A sequence takes a new block only when its last block is full, so at most
block_size - 1 slots per sequence are ever unused (the tail of its last block).

This file is the table work: admitting a sequence with its prefix hit, growing and
copying its blocks, releasing them, and the accounting. Its collaborators, each in a file
of its own: the admission policy (admission.py: reserve or watermark), prefix sharing
(sharing.py: lookup, publish, fork, copy-on-write bookkeeping), and swap, speculative
rollback and retention (swap_retention.py). Blocks themselves come from the
`BlockAllocator` (allocator.py): free, used or cached.
"""

from __future__ import annotations

import torch

from kvlab.cache.admission import ADMISSIONS, first_step_end, worst_case_blocks
from kvlab.cache.allocator import BlockAllocator
from kvlab.cache.base import KVCache
from kvlab.cache.pool import KVPool
from kvlab.cache.prefix import PREFIX_INDEXES, PrefixIndex, PrefixMatch
from kvlab.cache.prefix.history import PrefixHistory
from kvlab.cache.registry import CACHES
from kvlab.cache.retention import DROPPED, RETENTION, RetentionPolicy, leading_kept
from kvlab.cache.sharing import PrefixSharing
from kvlab.cache.swap_retention import SwapAndRetention
from kvlab.integrity import require
from kvlab.sequence import Sequence
from kvlab.units import ceil_div


@CACHES.register("paged")
class PagedCache(PrefixSharing, SwapAndRetention, KVCache):
    shares_prefixes = forks = swaps = emits_events = True
    admissions = ("watermark", "reserve")  # the first is the default, as vLLM

    def __init__(
        self,
        pool: KVPool,
        block_size: int,
        max_model_len: int,
        poison_freed: bool = False,
        prefix_index: PrefixIndex | None = None,
        watermark: float | None = None,
        retention: RetentionPolicy | None = None,
        connector=None,
    ):
        """`watermark`: None for reserve admission (the worst case promised, never
        preempts), else the fraction of the pool kept free after admitting a prompt.
        `connector`: a function making the KV connector below the pool from the cache
        (kvlab.cache.tiers), or None."""
        super().__init__(pool, block_size, max_model_len, poison_freed)
        self.index = prefix_index
        self.history = None if prefix_index is None else PrefixHistory(block_size)
        name = "reserve" if watermark is None else "watermark"
        self.admission = ADMISSIONS[name](self, watermark or 0.0)
        self.allocator = BlockAllocator(self.num_blocks, on_evict=self._evict)
        self.tables: dict[int, list[int]] = {}  # request id -> block table
        self.published: dict[int, int] = {}  # request id -> leading blocks it has indexed
        # block -> (request id, tokens it must reach): published before its tokens are
        # computed; its publisher writes it in place even while others share it
        self.unwritten: dict[int, tuple[int, int]] = {}
        self.copied_blocks = 0  # copy-on-write copies made
        self.retention = retention or RETENTION["full"](block_size, self.num_blocks)
        self.dropped_blocks = 0  # block-table entries a retention policy dropped
        self.connector = connector(self) if connector else None  # the tiers, if any

    @classmethod
    def slot_unit(cls, config, max_model_len: int) -> tuple[str, int]:
        return "block_size", config.block_size

    @classmethod
    def from_config(cls, config, pool: KVPool, max_model_len: int, events=None) -> PagedCache:
        """`events`: a kvlab.cache.events.EventSink the prefix index reports to (KV events;
        it needs prefix_caching="hash")."""
        if events is not None and not config.prefix_caching:
            raise ValueError("KV events need prefix caching: set prefix_caching='hash'")
        index = config.prefix_caching and PREFIX_INDEXES[config.prefix_caching].from_config(
            config, events
        )
        watermark = config.watermark if cls.admission_of(config) == "watermark" else None
        num_blocks = pool.num_slots // config.block_size
        retention = RETENTION[config.retention].from_config(config, num_blocks)
        connector = None
        if config.tiers is not None:  # the KV hierarchy below the pool
            from kvlab.cache.tiers.connector import tier_connector

            connector = tier_connector(config.tiers)
        return cls(pool, config.block_size, max_model_len, config.poison_freed, index,
                   watermark, retention, connector)  # fmt: skip

    # --- admission -----------------------------------------------------------------
    def check_fits(self, seq: Sequence) -> None:
        need = worst_case_blocks(self, seq)
        if need > self.num_blocks:
            raise ValueError(
                f"request needs {need} blocks of {self.block_size} tokens (prompt "
                f"{len(seq.prompt_ids)} + max_new_tokens {seq.params.max_new_tokens}) but the "
                f"KV budget holds only {self.num_blocks} blocks"
            )
        self.admission.check_group(seq)

    def _plan(self, seq: Sequence, alone: bool, chunk: int | None) -> PrefixMatch | None:
        """The prefix match `seq` is admitted with now, or None if it cannot be admitted.

        A partial (radix) hit pins its source block while copying it; when that pin is
        what stops the request from fitting, the partial tokens are recomputed instead.
        """
        match = self._lookup(seq)
        if self.admission.fits(seq, match, alone, chunk):
            return match
        full = PrefixMatch(match.blocks)
        if match.partial_block is not None and self.admission.fits(seq, full, alone, chunk):
            return full
        return None

    def _allocate(self, seq: Sequence, match: PrefixMatch, chunk: int | None) -> None:
        table = []
        for block in match.blocks:
            self.allocator.incref(block)
            table.append(block)
        self.tables[seq.request_id] = table
        hit = len(table) * self.block_size
        if match.partial_block is not None:
            # Token-granular hit (radix): copy the matching slots instead of recomputing.
            source = match.partial_block
            self.allocator.incref(source)  # keep it from being evicted by our allocation
            table.append(self._take_block())
            self._copy_slots(source, table[-1], match.partial_tokens)
            self.allocator.decref(source, keep_cached=source in self.index)
            hit += match.partial_tokens
        if self.index is not None:
            self._explain_hit(seq, match, hit)
        seq.num_computed = seq.prefix_hit_tokens = hit
        if self.admission.takes_first_step:
            self.ensure_capacity(seq, first_step_end(self, seq, match, chunk))

    # --- growth --------------------------------------------------------------------
    def must_copy(self, seq: Sequence) -> bool:
        """The block the next write of `seq` lands in is shared: it must be copied first."""
        table = self.tables[seq.request_id]
        first = seq.num_computed // self.block_size
        if first >= len(table) or self.allocator.ref_counts[table[first]] == 1:
            return False
        # Others share it: they read what is there (copy it first), unless they wait for
        # exactly what `seq` is about to write (it published the block ahead of its step).
        return self._computed(table[first], writer=seq)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        table = self.tables[seq.request_id]
        grow = max(0, ceil_div(num_tokens, self.block_size) - len(table))
        return grow + self.must_copy(seq)

    def ensure_capacity(self, seq: Sequence, num_tokens: int) -> None:
        table = self.tables[seq.request_id]
        if self.must_copy(seq):
            self._copy_on_write(seq, seq.num_computed // self.block_size)
        while len(table) * self.block_size < num_tokens:
            table.append(self._take_block())

    def _copy_on_write(self, seq: Sequence, index: int) -> None:
        table = self.tables[seq.request_id]
        shared = table[index]
        fresh = self._take_block()
        self._copy_slots(shared, fresh, seq.num_computed - index * self.block_size)
        table[index] = fresh
        self.allocator.decref(shared, keep_cached=self._indexed(shared))
        self.copied_blocks += 1

    def _copy_slots(self, source: int, target: int, count: int) -> None:
        offsets = torch.arange(count, device=self.pool.device)
        self.pool.copy(source * self.block_size + offsets, target * self.block_size + offsets)

    # --- release -------------------------------------------------------------------
    def _release(self, seq: Sequence) -> list[int]:
        table = self.tables.pop(seq.request_id)
        self.published.pop(seq.request_id, None)
        if self.history is not None:
            self.history.forget(seq.request_id)
        for block in table:
            if self.unwritten.get(block, (None,))[0] == seq.request_id:
                del self.unwritten[block]
        if self.index is not None:
            self._withdraw_uncomputed(seq, table)
            kept = leading_kept(table)  # blocks after a dropped one are never indexed
            tokens = seq.token_ids[: min(seq.num_computed, kept * self.block_size)]
            whole = kept == len(table)
            sole_owner = whole and bool(table) and self.allocator.ref_counts[table[-1]] == 1
            self.index.insert(tokens, table[:kept], seq.salt, partial=sole_owner)
            if self.connector is not None:  # tiers: record salts, write-through saves
                self.connector.request_finished(seq, table)
        # Tail blocks first: they become the least recently used, so evicted first.
        held = [b for b in reversed(table) if b != DROPPED]
        return [b for b in held if self.allocator.decref(b, self._indexed(b))]

    # --- accounting ----------------------------------------------------------------
    def block_table(self, seq: Sequence) -> list[int]:
        return self.tables[seq.request_id]

    @property
    def num_available(self) -> int:
        """Blocks an allocation can take: free ones and evictable cached ones (what vLLM
        calls free: a cached block with no reference is free to reuse)."""
        return self.allocator.num_available

    def reserved_slots(self) -> int:
        return self.allocator.num_used * self.block_size

    def live_tokens(self) -> int:
        """Tokens stored in referenced blocks, each shared block counted once."""
        filled: dict[int, int] = {}
        for request_id, seq in self.sequences.items():
            for i, block in enumerate(self.tables[request_id]):
                if block == DROPPED:
                    continue
                tokens = min(self.block_size, seq.num_computed - i * self.block_size)
                filled[block] = max(filled.get(block, 0), tokens)
        return sum(filled.values())

    def block_owners(self) -> list[int]:
        """Owner request id per block; -1 free or cached, -2 shared by several requests."""
        owners = [-1] * self.num_blocks
        for request_id, table in self.tables.items():
            for block in table:
                if block != DROPPED:
                    owners[block] = request_id if owners[block] == -1 else -2
        return owners

    def check_integrity(self) -> None:
        self.allocator.check_integrity()
        counts = [0] * self.num_blocks
        salts: dict[int, set] = {}
        for request_id, table in self.tables.items():
            for block in (b for b in table if b != DROPPED):
                counts[block] += 1
                salts.setdefault(block, set()).add(self.sequences[request_id].salt)
        require(counts == self.allocator.ref_counts, "reference counts != table references")
        require(all(len(s) == 1 for s in salts.values()), "a block is shared across salts")
        require(set(self.tables) == set(self.sequences), "block tables != admitted sequences")
        for block in self.allocator.cached:
            require(self._indexed(block), f"cached block {block} is not in the prefix index")
        for block in self.allocator.free_blocks:
            require(not self._indexed(block), f"free block {block} is in the prefix index")
        for request_id, table in self.tables.items():
            tail = self.sequences[request_id].num_computed // self.block_size
            require(DROPPED not in table[tail:], f"request {request_id} dropped an unfilled block")
        for request_id, seq in self.sequences.items():
            held = len(self.tables[request_id]) * self.block_size
            require(seq.num_computed <= held, f"request {request_id} has tokens outside its blocks")
        require(
            self.admission.promised() <= self.allocator.num_available,
            "reserve admission promised more blocks than are available",
        )
        if self.connector is not None:
            self.connector.check_integrity()
