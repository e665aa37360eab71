"""The paged cache: KV in fixed-size blocks, found through a per-sequence block table.

A sequence takes a new block only when its last block is full, so at most
block_size - 1 slots per sequence are ever unused (the tail of its last block).

This file is the table work: admitting a sequence with its prefix hit, growing and
copying its blocks, swapping them out and back, rolling back rejected drafts, dropping
what a retention policy no longer keeps, releasing them, and the accounting. Its parts
are members, each in a file of its own: the block allocator (allocator.py: free, used or
cached blocks), the admission policy (admission.py: reserve or watermark), prefix
sharing (sharing.py: the prefix index, what each request published), the retention
policy (retention/) and the KV connector to the tiers below (tiers/).
"""

from __future__ import annotations

import torch

from kvlab.cache.admission import ADMISSIONS, first_step_end, worst_case_blocks
from kvlab.cache.allocator import BlockAllocator
from kvlab.cache.base import KVCache
from kvlab.cache.codecs import StoredKV
from kvlab.cache.pool import KVPool
from kvlab.cache.prefix import PREFIX_INDEXES, PrefixIndex, PrefixMatch
from kvlab.cache.registry import CACHES
from kvlab.cache.retention import DROPPED, RETENTION, RetentionPolicy
from kvlab.cache.sharing import PrefixSharing
from kvlab.integrity import require
from kvlab.sequence import Sequence
from kvlab.units import ceil_div


@CACHES.register("paged")
class PagedCache(KVCache):
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
        name = "reserve" if watermark is None else "watermark"
        self.admission = ADMISSIONS[name](self, watermark or 0.0)
        allocator = BlockAllocator(self.num_blocks, on_evict=self._evict)
        self.sharing = PrefixSharing(
            prefix_index, block_size, allocator, self.sequences, pool.codec.alignment
        )
        self.tables: dict[int, list[int]] = {}  # request id -> block table
        self.copied_blocks = 0  # copy-on-write copies made
        self.retention = retention or RETENTION["full"](block_size, self.num_blocks)
        self.dropped_blocks = 0  # block-table entries a retention policy dropped
        self.connector = connector(self) if connector else None  # the tiers, if any

    @property
    def allocator(self) -> BlockAllocator:
        """The block allocator: free, used and cached blocks (prefix sharing reads it too)."""
        return self.sharing.allocator

    @allocator.setter
    def allocator(self, allocator: BlockAllocator) -> None:
        """Use another allocator (the labs plug a learner's in, before any request)."""
        self.sharing.allocator = allocator

    @property
    def index(self) -> PrefixIndex | None:
        """The prefix index (None without prefix caching); `sharing` owns it."""
        return self.sharing.index

    @index.setter
    def index(self, index: PrefixIndex | None) -> None:
        """Use another prefix index (the capstone plugs a learner's block hash in): only
        before any request, as prefix sharing starts afresh around it."""
        require(not self.tables, "the prefix index is replaced only before any request")
        bs, alignment = self.block_size, self.pool.codec.alignment
        self.sharing = PrefixSharing(index, bs, self.allocator, self.sequences, alignment)

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
        match = self.sharing.lookup(seq)
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
            self.sharing.explain_hit(seq, match, hit)
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
        return self.sharing.computed(table[first], writer=seq)

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
        self.allocator.decref(shared, keep_cached=self.sharing.indexed(shared))
        self.copied_blocks += 1

    def _copy_slots(self, source: int, target: int, count: int) -> None:
        offsets = torch.arange(count, device=self.pool.device)
        self.pool.copy(source * self.block_size + offsets, target * self.block_size + offsets)

    # --- release -------------------------------------------------------------------
    def _release(self, seq: Sequence) -> list[int]:
        table = self.tables.pop(seq.request_id)
        self.sharing.release(seq, table)
        if self.connector is not None:  # tiers: record salts, write-through saves
            self.connector.request_finished(seq, table)
        # Tail blocks first: they become the least recently used, so evicted first.
        held = [b for b in reversed(table) if b != DROPPED]
        return [b for b in held if self.allocator.decref(b, self.sharing.indexed(b))]

    # --- prefix sharing (its bookkeeping: kvlab.cache.sharing) ---------------------
    def stage(self, seq: Sequence) -> None:
        """Tiers: load the blocks of `seq`'s prompt that a tier holds back onto the device,
        as cached blocks its prefix lookup then hits, before admission is decided: what
        the admission decision counts is what allocate_slots then takes."""
        if self.connector is not None and not seq.num_computed:
            self.connector.promote(seq)

    def publish(self, seq: Sequence, upto: int | None = None) -> None:
        """Index the full blocks of `seq`'s first `upto` tokens (default: those computed)
        for other requests to reuse, before or after its step computes them."""
        self.sharing.publish(seq, self.tables[seq.request_id], upto)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares all of `parent`'s blocks (n > 1 sampling); writes copy on demand."""
        table = list(self.tables[parent.request_id])
        for block in table:
            if block != DROPPED:
                self.allocator.incref(block)
        self.tables[child.request_id] = table
        self.sequences[child.request_id] = child
        self.sharing.fork(parent, child)

    def _evict(self, block: int) -> None:
        """The allocator evicts a cached block: the tiers may keep a copy, then the index
        forgets it."""
        if self.connector is not None:
            self.connector.on_evict(block)
        self.sharing.forget(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, as vLLM's reset_prefix_cache: only when no request
        holds a block (False otherwise, nothing changed); tier copies stay."""
        return self.sharing.reset()

    def forget_prefixes(self, prefixes: list[tuple], keep: set[bytes]) -> dict[str, int]:
        """Free the cached blocks holding `prefixes` ((tokens, salt) pairs) on the device and
        delete their copies in every tier, but the blocks whose chained key is in `keep`
        (another live session uses them). Returns the blocks freed per tier."""
        device, keys = self.sharing.drop_prefixes(prefixes, keep)
        freed = {"device": device}
        for key in keys if self.connector is not None else ():
            for tier in self.connector.discard(key):
                freed[tier] = freed.get(tier, 0) + 1
        return freed

    # --- swap ------------------------------------------------------------------------
    def swap_out(self, seq: Sequence) -> StoredKV:
        """Read `seq`'s stored KV to host memory and free its blocks (swap preemption; with
        tiers the swap space is the host tier's memory)."""
        saved = self.pool.read(self.position_slots(seq, 0, seq.num_computed))
        self.free(seq)
        if self.connector is not None:
            self.connector.swap_out(seq, saved)
        return saved

    def allocate_computed(self, seq: Sequence, alone: bool = False) -> list[int] | None:
        """A block table for `seq`'s `num_computed` tokens and its next one, whose KV is
        written in from outside (swap-in restores it, a KV connector loads it:
        kvlab.disagg) -> the table; or None, and nothing taken, when the blocks would
        endanger running sequences (`alone`: none is running). Deciding and taking are one
        call, as in `allocate_slots`."""
        held = ceil_div(seq.num_computed + 1, self.block_size)
        need = self.admission.resume_blocks(seq, held)  # reserve: its worst case
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

    # --- rollback and retention (kvlab.cache.retention) ------------------------------
    def _trim(self, seq: Sequence) -> list[int]:
        """Speculative rollback: blocks past the kept tokens held only rejected drafts
        (never published, never shared): they go straight back to the free list."""
        table = self.tables[seq.request_id]
        keep = ceil_div(seq.num_computed, self.block_size)
        dropped = table[keep:]
        for block in dropped:
            require(
                self.allocator.ref_counts[block] == 1 and not self.sharing.indexed(block),
                f"block {block} past request {seq.request_id}'s tokens is shared or indexed",
            )
        del table[keep:]
        return [b for b in dropped if self.allocator.decref(b)]

    def _take_block(self) -> int:
        block = self.allocator.allocate()
        self.retention.on_allocate(block)
        return block

    def retain(self, seq: Sequence) -> None:
        """After a step: drop the blocks of `seq` its retention policy no longer keeps. The
        table keeps a `DROPPED` entry in their place (only the leading run of kept blocks
        is ever indexed); a block no other table holds leaves the prefix index and goes
        back to the free list."""
        table = self.tables[seq.request_id]
        freed = []
        for i in self.retention.drop(table, seq.num_computed):
            block, table[i] = table[i], DROPPED
            if self.allocator.ref_counts[block] == 1 and self.sharing.indexed(block):
                self.sharing.forget(block)
            if self.allocator.decref(block):
                freed.append(block)
            self.dropped_blocks += 1
        if self.poison_freed and freed:
            self.pool.poison(self.block_slots(freed))

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
            require(self.sharing.indexed(block), f"cached block {block} is not in the prefix index")
        for block in self.allocator.free_blocks:
            require(not self.sharing.indexed(block), f"free block {block} is in the prefix index")
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
