"""Prefix sharing for the paged cache: look a prompt up, publish what a sequence computed,
and forget blocks when they are evicted or their session ends.

With a prefix index (`prefix_caching="hash" | "radix"`), admission first looks the
prompt up: matched blocks join the new table by reference (their tokens are not computed
again), and a finished sequence's blocks stay cached for later requests until evicted.
The scheduler publishes what a step will compute as soon as it schedules it (so a request
admitted later in the same step shares it, as in vLLM V1); such a block is *unwritten*
until its step runs, and a block referenced by several tables is never written: the
first write to it copies it (copy-on-write), unless the writer is the one its sharers wait
for.

`PrefixSharing` is a member of the paged cache (`cache.sharing`), as vLLM's block pool
holds its map of cached block hashes: it owns the prefix index and what each request has
published, reads the cache's allocator and admitted sequences, and is handed the block
table of the request it works on. Without an index it shares nothing.
"""

from __future__ import annotations

from kvlab.cache.allocator import BlockAllocator
from kvlab.cache.prefix import PrefixIndex, PrefixMatch
from kvlab.cache.prefix.hash import HashPrefixIndex
from kvlab.cache.prefix.history import MISS_REASONS, PrefixHistory
from kvlab.cache.retention import leading_kept
from kvlab.integrity import require
from kvlab.sequence import Note, Sequence


class PrefixSharing:
    """The prefix index of a paged cache and the bookkeeping of what is published."""

    def __init__(
        self,
        index: PrefixIndex | None,
        block_size: int,
        allocator: BlockAllocator,
        sequences: dict[int, Sequence],
        alignment: int = 1,
        gaps: bool = False,
    ):
        """`sequences`: the cache's admitted sequences by request id (read, never changed);
        `alignment`: the codec's token group (a partial hit copies whole groups); `gaps`:
        index every kept block, also those after a dropped one (a sliding-window group
        of kvlab.cache.hybrid, whose hits need only the blocks its window reaches), not
        only the leading run of kept blocks (what a left-to-right match can reach)."""
        self.index = index
        self.gaps = gaps
        self.history = None if index is None else PrefixHistory(block_size)
        self.block_size = block_size
        self.allocator = allocator
        self.sequences = sequences
        self.alignment = alignment
        self.published: dict[int, int] = {}  # request id -> leading blocks it has indexed
        # block -> (request id, tokens it must reach): published before its tokens are
        # computed; its publisher writes it in place even while others share it
        self.unwritten: dict[int, tuple[int, int]] = {}

    def lookup(self, seq: Sequence) -> PrefixMatch:
        """Cached prefix of the prompt, leaving at least its last token to compute."""
        if self.index is None or seq.num_computed:
            return PrefixMatch([])
        match = self.index.match(seq.prompt_ids, seq.salt)
        limit = len(seq.prompt_ids) - 1  # the last prompt token must run to give logits
        full = match.blocks[: limit // self.block_size]
        partial_source = match.partial_block
        if len(full) < len(match.blocks) or partial_source is None:
            return PrefixMatch(full)
        if not self.computed(partial_source):
            return PrefixMatch(full)  # its slots are not written yet: nothing to copy
        partial = min(match.partial_tokens, limit - len(full) * self.block_size)
        partial -= partial % self.alignment  # grouped codes copy whole groups
        return PrefixMatch(full, match.partial_block, partial) if partial else PrefixMatch(full)

    def explain_hit(self, seq: Sequence, match: PrefixMatch, hit: int) -> None:
        """Note on `seq` how much of its prompt hit the cache and, if not all, why not."""
        raw = self.index.match(seq.prompt_ids, seq.salt)
        prompt = len(seq.prompt_ids)
        label = self.history.miss_reason(
            seq.prompt_ids, seq.salt, hit, self.index.token_granular,
            copy_refused=raw.partial_block is not None and not self.computed(raw.partial_block),
        )  # fmt: skip
        if match.partial_block is None and self.lookup(seq).partial_block is not None:
            label = "no room to copy"
        text = f"prefix cache: {hit} of {prompt} prompt tokens hit"
        if label is None:
            text += " (all but the last, which always runs)"
        else:
            block = hit // self.block_size
            text += f"; missed from block {block} on: {label}: {MISS_REASONS[label]}"
        seq.notes.append(Note("prefix", label or "hit", text))

    def publish(self, seq: Sequence, table: list[int], upto: int | None = None) -> None:
        """Index the full blocks of `seq`'s first `upto` tokens (default: those computed),
        for other requests to reuse. A block whose tokens are not computed yet is recorded
        as unwritten; `release` withdraws it if they never are (a request preempted before
        its step ran)."""
        upto = seq.num_computed if upto is None else upto
        upto = min(upto, self._indexable(table) * self.block_size)
        full = upto // self.block_size
        if self.index is None or full <= self.published.get(seq.request_id, 0):
            return
        for i in range(self.published.get(seq.request_id, 0), full):
            end = (i + 1) * self.block_size
            if seq.num_computed < end:
                self.unwritten[table[i]] = (seq.request_id, end)
        self.index.insert(seq.token_ids[:upto], table[:full], seq.salt)
        self.history.record(seq.request_id, seq.token_ids[:upto], seq.salt)
        self.published[seq.request_id] = full

    def computed(self, block: int, writer: Sequence | None = None) -> bool:
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

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` took `parent`'s table: it has published what `parent` has."""
        self.published[child.request_id] = self.published.get(parent.request_id, 0)

    def release(self, seq: Sequence, table: list[int]) -> None:
        """`seq` gives its table back: unindex what it published but never computed, and
        index what it did compute (the leading run of kept blocks; its last, partly
        filled block too where it is the sole owner and the index is token-granular)."""
        self.published.pop(seq.request_id, None)
        if self.history is not None:
            self.history.forget(seq.request_id)
        for block in table:
            if self.unwritten.get(block, (None,))[0] == seq.request_id:
                del self.unwritten[block]
        if self.index is None:
            return
        for block in table[seq.num_computed // self.block_size :]:
            if self.indexed(block):
                require(
                    self.allocator.ref_counts[block] == 1,
                    f"block {block} is shared before its tokens were computed",
                )
                self.forget(block)
        kept = self._indexable(table)  # blocks after a dropped one: only with gaps
        tokens = seq.token_ids[: min(seq.num_computed, kept * self.block_size)]
        whole = kept == len(table)
        sole_owner = whole and bool(table) and self.allocator.ref_counts[table[-1]] == 1
        self.index.insert(tokens, table[:kept], seq.salt, partial=sole_owner)

    def _indexable(self, table: list[int]) -> int:
        """Leading blocks of `table` the index may hold (the dropped ones among them are
        skipped by the index)."""
        return len(table) if self.gaps else leading_kept(table)

    def indexed(self, block: int) -> bool:
        return self.index is not None and block in self.index

    def forget(self, block: int) -> None:
        """Drop a block from the index (evicted, or never computed), and free what hung
        below it."""
        for orphan in self.index.remove(block):
            if orphan in self.allocator.cached:
                self.allocator.uncache(orphan)

    def reset(self) -> bool:
        """Forget every cached block, as vLLM's reset_prefix_cache: only when no request
        holds a block (False otherwise, nothing changed). The index reports one
        AllBlocksCleared, not a removal per block."""
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

    def drop_prefixes(self, prefixes: list[tuple], keep: set[bytes]) -> tuple[int, list[bytes]]:
        """Free the cached blocks holding `prefixes` ((tokens, salt) pairs) but those whose
        chained key is in `keep` -> (blocks freed, the keys dropped: for the tiers)."""
        if self.index is None:
            return 0, []
        keyer = self.index if hasattr(self.index, "keys") else HashPrefixIndex(self.block_size)
        by_key = getattr(self.index, "block_of", None)  # hash: every indexed key
        freed, dropped = 0, []
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
                    self.forget(block)
                    if block in self.allocator.cached:
                        self.allocator.uncache(block)
                    freed += 1
                dropped.append(key)
        return freed, dropped
