"""The paged cache: KV in fixed-size blocks, found through a per-sequence block table.

A sequence takes a new block only when its last block is full, so at most
block_size - 1 slots per sequence are ever unused (the tail of its last block).

Admission is one of two policies:

- reserve: a request is admitted only if the blocks it could ever need fit beside what
  running sequences could still claim (`future_blocks`: growth to
  ceil(min(prompt + max_new_tokens, max_model_len) / block_size), one copy of a shared
  block it will write, and the tails of its n - 1 samples not yet forked). Blocks are
  taken lazily, so memory is only *held* as tokens arrive, but nobody ever runs out.
- watermark: a request is admitted when the blocks of its first step's tokens (its
  prompt, or the first chunk of it) fit and `watermark` of the pool stays free for
  running sequences to grow into (waived when none runs). Later chunks and decodes take
  blocks as they run, as in vLLM V1; when blocks run out the scheduler preempts.

With a prefix index (`prefix_caching="hash" | "radix"`), admission first looks the
prompt up: matched blocks join the new table by reference (their tokens are not computed
again), and a finished sequence's blocks stay cached for later requests until evicted.
A block referenced by several tables is never written: the first write to it copies it
(copy-on-write).

A retention policy (`retention`, kvlab.cache.retention) may drop whole blocks of a
running sequence after each step (`retain`): the table keeps a `DROPPED` entry in their
place, the block goes back to the allocator, and only the leading run of kept blocks is
ever indexed for prefix sharing.
"""

from __future__ import annotations

import torch

from kvlab.cache import CACHES
from kvlab.cache.allocator import BlockAllocator
from kvlab.cache.base import KVCache
from kvlab.cache.codecs import StoredKV
from kvlab.cache.pool import KVPool
from kvlab.cache.prefix import PREFIX_INDEXES, PrefixIndex, PrefixMatch
from kvlab.cache.prefix.history import MISS_REASONS, PrefixHistory
from kvlab.cache.retention import DROPPED, RETENTION, RetentionPolicy, leading_kept
from kvlab.engine.sequence import Note, Sequence
from kvlab.integrity import require
from kvlab.units import ceil_div


@CACHES.register("paged")
class PagedCache(KVCache):
    shares_prefixes = forks = swaps = True
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
    ):
        super().__init__(pool, block_size, max_model_len, poison_freed)
        self.index = prefix_index
        self.history = None if prefix_index is None else PrefixHistory(block_size)
        # None: reserve admission (worst case promised, never preempts). Otherwise the
        # number of blocks that must stay free after admitting a prompt.
        self.watermark_blocks = None if watermark is None else int(watermark * self.num_blocks)
        self.allocator = BlockAllocator(self.num_blocks, on_evict=self._evict)
        self.connector = None  # a TierConnector when EngineConfig.tiers is set (kvlab.cache.tiers)
        self.tables: dict[int, list[int]] = {}  # request id -> block table
        self.published: dict[int, int] = {}  # request id -> leading blocks it has indexed
        # block -> (request id, tokens it must reach): published before its tokens are
        # computed; its publisher writes it in place even while others share it
        self.unwritten: dict[int, tuple[int, int]] = {}
        self.copied_blocks = 0  # copy-on-write copies made
        self.retention = retention or RETENTION["full"](block_size, self.num_blocks)
        self.dropped_blocks = 0  # block-table entries a retention policy dropped

    @classmethod
    def slot_unit(cls, config, max_model_len: int) -> tuple[str, int]:
        return "block_size", config.block_size

    @classmethod
    def from_config(cls, config, pool: KVPool, max_model_len: int) -> PagedCache:
        index = config.prefix_caching and PREFIX_INDEXES[config.prefix_caching](config.block_size)
        watermark = config.watermark if config.admission_policy == "watermark" else None
        retention = RETENTION[config.retention].from_config(
            config, pool.num_slots // config.block_size
        )
        cache = cls(
            pool, config.block_size, max_model_len, config.poison_freed, index, watermark, retention
        )
        if config.tiers is not None:  # the KV hierarchy below the pool
            from kvlab.cache.tiers import TierStack
            from kvlab.cache.tiers.connector import TierConnector

            cache.connector = TierConnector(cache, TierStack.from_config(config.tiers))
        return cache

    @property
    def reserves(self) -> bool:
        """Reserve admission: every admitted request is promised its worst case."""
        return self.watermark_blocks is None

    # --- admission -----------------------------------------------------------------
    def worst_case_blocks(self, seq: Sequence) -> int:
        tokens = min(len(seq.prompt_ids) + seq.params.max_new_tokens, self.max_model_len)
        return ceil_div(tokens, self.block_size)

    def unforked_blocks(self, seq: Sequence) -> int:
        """Blocks the n - 1 samples not yet forked from `seq` may claim: each shares the
        prompt's full blocks and grows its own tail; one more for the copy of a shared,
        partly filled last prompt block (every sharer but the last writer copies it)."""
        if seq.params.n == 1 or seq.parent_id is not None or seq.first_token_s is not None:
            return 0
        prompt = len(seq.prompt_ids)
        tail = self.worst_case_blocks(seq) - prompt // self.block_size
        return (seq.params.n - 1) * tail + (prompt % self.block_size != 0)

    def check_fits(self, seq: Sequence) -> None:
        need = self.worst_case_blocks(seq)
        if need > self.num_blocks:
            raise ValueError(
                f"request needs {need} blocks of {self.block_size} tokens (prompt "
                f"{len(seq.prompt_ids)} + max_new_tokens {seq.params.max_new_tokens}) but the "
                f"KV budget holds only {self.num_blocks} blocks"
            )
        group = need + self.unforked_blocks(seq)
        if self.reserves and group > self.num_blocks:
            raise ValueError(
                f"request with SamplingParams.n={seq.params.n} needs {group} blocks of "
                f"{self.block_size} tokens for all its samples under reserve admission, but "
                f"the KV budget holds only {self.num_blocks} blocks"
            )

    def _lookup(self, seq: Sequence) -> PrefixMatch:
        """Cached prefix of the prompt, leaving at least its last token to compute."""
        if self.index is None or seq.num_computed:
            return PrefixMatch([])
        match = self.index.match(seq.prompt_ids, seq.salt)
        limit = len(seq.prompt_ids) - 1  # the last prompt token must run to give logits
        full = match.blocks[: limit // self.block_size]
        partial_source = match.partial_block
        if len(full) < len(match.blocks) or partial_source is None:
            return PrefixMatch(full)
        if not self._computed(partial_source):
            return PrefixMatch(full)  # its slots are not written yet: nothing to copy
        partial = min(match.partial_tokens, limit - len(full) * self.block_size)
        partial -= partial % self.pool.codec.alignment  # grouped codes copy whole groups
        return PrefixMatch(full, match.partial_block, partial) if partial else PrefixMatch(full)

    def _pinned(self, match: PrefixMatch) -> int:
        """Cached blocks that admitting `match` takes out of the LRU pool: the matched
        ones, and the partial source while it is copied."""
        blocks = match.blocks + ([match.partial_block] if match.partial_block is not None else [])
        return sum(1 for b in blocks if b in self.allocator.cached)

    def _fits(self, seq: Sequence, match: PrefixMatch, alone: bool, chunk: int | None) -> bool:
        available = self.allocator.num_available - self._pinned(match)
        if self.reserves:
            need = self.worst_case_blocks(seq) - len(match.blocks) + self.unforked_blocks(seq)
            return need <= available - self.promised_blocks()
        first = self._first_step_end(seq, match, chunk)
        need = ceil_div(first, self.block_size) - len(match.blocks)
        return need <= available - self._headroom(alone)

    def _first_step_end(self, seq: Sequence, match: PrefixMatch, chunk: int | None) -> int:
        """Tokens `seq` holds after its first step: the prefix hit, then `chunk` more
        (None: every token it has)."""
        hit = len(match.blocks) * self.block_size + match.partial_tokens
        return seq.num_tokens if chunk is None else min(seq.num_tokens, hit + chunk)

    def _plan(self, seq: Sequence, alone: bool, chunk: int | None) -> PrefixMatch | None:
        """The prefix match `seq` is admitted with now, or None if it cannot be admitted.

        A partial (radix) hit pins its source block while copying it; when that pin is
        what stops the request from fitting, the partial tokens are recomputed instead.
        """
        match = self._lookup(seq)
        if self._fits(seq, match, alone, chunk):
            return match
        full = PrefixMatch(match.blocks)
        if match.partial_block is not None and self._fits(seq, full, alone, chunk):
            return full
        return None

    def can_admit(self, seq: Sequence, alone: bool = False, chunk: int | None = None) -> bool:
        """Whether `seq` can be admitted now. `alone`: no sequence is running; `chunk`:
        the most tokens its first step computes (None: all)."""
        return self._plan(seq, alone, chunk) is not None

    def _headroom(self, alone: bool) -> int:
        """Blocks watermark admission keeps free for running sequences (none if none run)."""
        return 0 if alone or self.reserves else self.watermark_blocks

    def stage(self, seq: Sequence) -> None:
        """Tiers: load the blocks of `seq`'s prompt that a tier holds back onto the device,
        as cached blocks its prefix lookup then hits, before admission is decided: what
        `can_admit` counts is what `admit` takes."""
        if self.connector is not None and not seq.num_computed:
            self.connector.promote(seq)

    def _allocate(self, seq: Sequence, alone: bool, chunk: int | None) -> None:
        match = self._plan(seq, alone, chunk)
        if match is None:
            raise ValueError(f"request {seq.request_id} does not fit: call can_admit() first")
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
        if not self.reserves:
            # Take the first step's blocks now, so the next admission in the same step
            # sees them gone (watermark admission makes no promises to count instead).
            self.ensure_capacity(seq, self._first_step_end(seq, match, chunk))

    def _explain_hit(self, seq: Sequence, match: PrefixMatch, hit: int) -> None:
        """Note on `seq` how much of its prompt hit the cache and, if not all, why not."""
        raw = self.index.match(seq.prompt_ids, seq.salt)
        prompt = len(seq.prompt_ids)
        label = self.history.miss_reason(
            seq.prompt_ids, seq.salt, hit, self.index.token_granular,
            copy_refused=raw.partial_block is not None and not self._computed(raw.partial_block),
        )  # fmt: skip
        if match.partial_block is None and self._lookup(seq).partial_block is not None:
            label = "no room to copy"
        text = f"prefix cache: {hit} of {prompt} prompt tokens hit"
        if label is None:
            text += " (all but the last, which always runs)"
        else:
            block = hit // self.block_size
            text += f"; missed from block {block} on: {label}: {MISS_REASONS[label]}"
        seq.notes.append(Note("prefix", label or "hit", text))

    # --- promises (reserve admission) ----------------------------------------------
    def future_blocks(self, seq: Sequence) -> int:
        """Blocks `seq` may still take: growth to its worst case, a copy of the shared
        block its next write lands in, and its unforked samples' tails."""
        table = self.tables[seq.request_id]
        grow = max(0, self.worst_case_blocks(seq) - len(table))
        return grow + self._must_copy(seq) + self.unforked_blocks(seq)

    def promised_blocks(self) -> int:
        """Blocks reserve admission has promised to running sequences (0 for watermark)."""
        if not self.reserves:
            return 0
        return sum(self.future_blocks(seq) for seq in self.sequences.values())

    # --- growth --------------------------------------------------------------------
    def _must_copy(self, seq: Sequence) -> bool:
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
        return grow + self._must_copy(seq)

    def ensure_capacity(self, seq: Sequence, num_tokens: int) -> None:
        table = self.tables[seq.request_id]
        if self._must_copy(seq):
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

    # --- sharing -------------------------------------------------------------------
    def publish(self, seq: Sequence, upto: int | None = None) -> None:
        """Index the full blocks of `seq`'s first `upto` tokens (default: those computed),
        for other requests to reuse. The scheduler publishes what a step will compute as
        soon as it schedules it; `_release` withdraws any block whose tokens were never
        computed (a request preempted before its step ran)."""
        upto = seq.num_computed if upto is None else upto
        upto = min(upto, leading_kept(self.tables[seq.request_id]) * self.block_size)
        full = upto // self.block_size
        if self.index is None or full <= self.published.get(seq.request_id, 0):
            return
        table = self.tables[seq.request_id]
        for i in range(self.published.get(seq.request_id, 0), full):
            end = (i + 1) * self.block_size
            if seq.num_computed < end:
                self.unwritten[table[i]] = (seq.request_id, end)
        self.index.insert(seq.token_ids[:upto], table[:full], seq.salt)
        self.history.record(seq.request_id, seq.token_ids[:upto], seq.salt)
        self.published[seq.request_id] = full

    def _computed(self, block: int, writer: Sequence | None = None) -> bool:
        """Whether `block`'s tokens are in the pool (False: published ahead of the step
        that computes them). With `writer`: only if `writer` is the one to compute them."""
        entry = self.unwritten.get(block)
        if entry is None:
            return True
        owner = self.sequences.get(entry[0])
        pending = owner is not None and owner.num_computed < entry[1]
        if not pending:
            del self.unwritten[block]
        return not pending or (writer is not None and owner is not writer)

    def _withdraw_uncomputed(self, seq: Sequence, table: list[int]) -> None:
        """Unindex the published blocks of `seq` holding tokens that were never computed."""
        for block in table[seq.num_computed // self.block_size :]:
            if self._indexed(block):
                require(
                    self.allocator.ref_counts[block] == 1,
                    f"block {block} is shared before its tokens were computed",
                )
                self._forget(block)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares all of `parent`'s blocks (n > 1 sampling); writes copy on demand."""
        table = list(self.tables[parent.request_id])
        for block in table:
            if block != DROPPED:
                self.allocator.incref(block)
        self.tables[child.request_id] = table
        self.sequences[child.request_id] = child
        self.published[child.request_id] = self.published.get(parent.request_id, 0)

    def _indexed(self, block: int) -> bool:
        return self.index is not None and block in self.index

    def _evict(self, block: int) -> None:
        """The allocator evicts a cached block: the tiers may keep a copy, then it is
        forgotten."""
        if self.connector is not None:
            self.connector.on_evict(block)
        self._forget(block)

    def _forget(self, block: int) -> None:
        """Drop a block from the index (evicted, or never computed), and free what hung
        below it."""
        for orphan in self.index.remove(block):
            if orphan in self.allocator.cached:
                self.allocator.uncache(orphan)

    # --- swapping --------------------------------------------------------------------
    def swap_out(self, seq: Sequence) -> StoredKV:
        saved = self.pool.read(self.position_slots(seq, 0, seq.num_computed))
        self.free(seq)
        if self.connector is not None:  # tiers: the swap space is the host tier's memory
            self.connector.swap_out(seq, saved)
        return saved

    def can_swap_in(self, seq: Sequence, alone: bool = False) -> bool:
        need = ceil_div(seq.num_computed + 1, self.block_size)
        available = self.allocator.num_available - self.promised_blocks()
        return need <= available - self._headroom(alone)

    def swap_in(self, seq: Sequence, saved: StoredKV) -> None:
        self.allocate_computed(seq)
        self.pool.restore(self.position_slots(seq, 0, seq.num_computed), saved)
        self.drop_swapped(seq)

    def allocate_computed(self, seq: Sequence) -> list[int]:
        """A block table for `seq`'s `num_computed` tokens, whose KV is written in from
        outside: swap-in restores it, a KV connector loads it (kvlab.disagg). Returns it."""
        self.tables[seq.request_id] = []
        self.sequences[seq.request_id] = seq
        self.ensure_capacity(seq, seq.num_computed)
        return self.tables[seq.request_id]

    def drop_swapped(self, seq: Sequence) -> None:
        if self.connector is not None:
            self.connector.swap_done(seq)

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

    # --- accounting ----------------------------------------------------------------
    def block_table(self, seq: Sequence) -> list[int]:
        return self.tables[seq.request_id]

    @property
    def num_available(self) -> int:
        """Blocks an allocation can take: free ones and evictable cached ones."""
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
            self.promised_blocks() <= self.allocator.num_available,
            "reserve admission promised more blocks than are available",
        )
        if self.connector is not None:
            self.connector.check_integrity()
