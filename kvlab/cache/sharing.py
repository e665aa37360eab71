"""Prefix sharing for the paged cache: look a prompt up, publish what a sequence computed,
fork samples, and forget blocks when they are evicted or their session ends.

With a prefix index (`prefix_caching="hash" | "radix"`), admission first looks the
prompt up: matched blocks join the new table by reference (their tokens are not computed
again), and a finished sequence's blocks stay cached for later requests until evicted.
The scheduler publishes what a step will compute as soon as it schedules it (so a request
admitted later in the same step shares it, as in vLLM V1); such a block is *unwritten*
until its step runs, and a block referenced by several tables is never written: the
first write to it copies it (copy-on-write), unless the writer is the one its sharers wait
for. A tiered cache loads held blocks back before admission is decided (`stage`).
"""

from __future__ import annotations

from kvlab.cache.prefix import PrefixMatch
from kvlab.cache.prefix.hash import HashPrefixIndex
from kvlab.cache.prefix.history import MISS_REASONS
from kvlab.cache.retention import DROPPED, leading_kept
from kvlab.integrity import require
from kvlab.sequence import Note, Sequence


class PrefixSharing:
    """PagedCache's prefix sharing (a mixin: it reads the cache's tables and allocator)."""

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

    def stage(self, seq: Sequence) -> None:
        """Tiers: load the blocks of `seq`'s prompt that a tier holds back onto the device,
        as cached blocks its prefix lookup then hits, before admission is decided: what
        the admission decision counts is what allocate_slots then takes."""
        if self.connector is not None and not seq.num_computed:
            self.connector.promote(seq)

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

    def publish(self, seq: Sequence, upto: int | None = None) -> None:
        """Index the full blocks of `seq`'s first `upto` tokens (default: those computed),
        for other requests to reuse. A block whose tokens are not computed yet is recorded
        as unwritten; `_release` withdraws it if they never are (a request preempted before
        its step ran)."""
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

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, as vLLM's reset_prefix_cache: only when no request
        holds a block (False otherwise, nothing changed). The index reports one
        AllBlocksCleared, not a removal per block; tier copies stay."""
        if self.index is None or self.allocator.num_used:
            return False
        self.unwritten.clear()
        if hasattr(self.index, "clear"):
            self.index.clear()
        else:
            for block in list(self.allocator.cached):
                if block in self.index:  # not an orphan of one removed before
                    self.index.remove(block)
        for block in list(self.allocator.cached):
            self.allocator.uncache(block)
        return True

    def forget_prefixes(self, prefixes: list[tuple], keep: set[bytes]) -> dict[str, int]:
        """Free the cached blocks holding `prefixes` ((tokens, salt) pairs) on the device and
        delete their copies in every tier, but the blocks whose chained key is in `keep`
        (another live session uses them). Returns the blocks freed per tier."""
        freed: dict[str, int] = {"device": 0}
        if self.index is None:
            return freed
        keyer = self.index if hasattr(self.index, "keys") else HashPrefixIndex(self.block_size)
        by_key = getattr(self.index, "block_of", None)  # hash: every indexed key
        for tokens, salt in prefixes:
            keys = keyer.keys(list(tokens), salt)
            if by_key is not None:
                blocks = [by_key.get(k) for k in keys]
            else:
                blocks = self.index.match(list(tokens), salt).blocks
            for i, key in enumerate(keys):
                if key in keep:
                    continue
                block = blocks[i] if i < len(blocks) else None
                if block is not None and block in self.allocator.cached:
                    self._forget(block)
                    if block in self.allocator.cached:
                        self.allocator.uncache(block)
                    freed["device"] += 1
                if self.connector is not None:
                    for tier in self.connector.discard(key):
                        freed[tier] = freed.get(tier, 0) + 1
        return freed
