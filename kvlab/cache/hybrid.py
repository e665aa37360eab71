"""The hybrid cache: a block table per KV cache group, over one pool and one allocator.

vLLM's hybrid KV cache manager, for models that mix full-attention and sliding-window
layers (kvlab.cache.groups says how layers form groups and what a prefix hit is). Each
group is a paged cache of its own (`GroupTables`) sharing the pool, the block allocator
and its LRU with the others:

- a full group keeps every block of its sequence, as the paged cache does;
- a sliding group drops, after every step, the blocks its window no longer reaches
  (vLLM's `remove_skipped_blocks`: those before token `num_computed - W + 1`); a dropped
  block stays cached while the LRU keeps it, so a later prompt may still hit it;
- admission takes, in one call, the blocks every group needs beyond the prefix hit that
  every group can serve (`cross_group_hit`), or nothing.

Each group's index hashes the same chained block keys; a group's KV events carry its
`group_idx`, as vLLM's do. With every layer full there is one group, and the hybrid
cache computes what the paged cache does.

What it does not combine with yet (a ValueError names each): swap preemption, radix
prefix caching, reserve admission, retention policies, tiers, speculation, tensor
parallelism, disaggregation and batch-invariant mode.
"""

from __future__ import annotations

import dataclasses

from kvlab.cache.admission import tokens_after_first_step, worst_case_blocks
from kvlab.cache.allocator import BlockAllocator
from kvlab.cache.base import KVCache
from kvlab.cache.events import AllBlocksCleared
from kvlab.cache.groups import KVCacheGroup, cross_group_hit
from kvlab.cache.paged import PagedCache
from kvlab.cache.pool import KVPool
from kvlab.cache.prefix import PREFIX_INDEXES
from kvlab.cache.registry import CACHES
from kvlab.cache.retention import DROPPED, RETENTION
from kvlab.cache.sharing import PrefixSharing
from kvlab.integrity import require
from kvlab.sequence import Note, Sequence
from kvlab.units import ceil_div


class GroupTables(PagedCache):
    """One KV cache group's block tables: a paged cache whose allocator is shared.

    A sliding group's retention is its window: it keeps the blocks from token
    `num_computed - W + 1` on, and a block it drops stays in its prefix index (cached)
    until the shared LRU evicts it."""

    def __init__(self, group: KVCacheGroup, pool: KVPool, block_size: int, max_model_len: int,
                 poison_freed: bool, index, allocator: BlockAllocator,
                 interval: int | None = None):  # fmt: skip
        window = group.window
        retention = None if window is None else RETENTION["window"](block_size, 0, window - 1)
        super().__init__(pool, block_size, max_model_len, poison_freed, index, 0.0, retention)
        self.group = group
        self.interval = interval  # prefix_cache_retention_interval, in tokens
        self.label = f"group {group.layers} (window {window})"
        self.sharing = PrefixSharing(
            index, block_size, allocator, self.sequences, gaps=window is not None
        )

    def retain(self, seq: Sequence) -> None:
        """Drop the blocks the window left: each goes back to the shared allocator, cached
        if indexed (vLLM frees a skipped block to its pool with its hash), unless a
        retention interval keeps only the blocks a hit at one of its multiples reads."""
        table, freed = self.tables[seq.request_id], []
        for i in self.retention.drop(table, seq.num_computed):
            block, table[i] = table[i], DROPPED
            cached = self.sharing.indexed(block)
            if cached and not self.checkpoint(i) and self.allocator.ref_counts[block] == 1:
                self.sharing.forget(block)
                cached = False
            if self.allocator.decref(block, keep_cached=cached):
                freed.append(block)
            self.dropped_blocks += 1
        if self.poison_freed and freed:
            self.pool.poison(self.block_slots(freed))

    def checkpoint(self, i: int) -> bool:
        """Whether block i stays cached once dropped: always without a retention interval;
        with one of `step` blocks, when a hit at the next multiple of `step` reads it."""
        if self.interval is None:
            return True
        step = self.interval // self.block_size
        return (i // step + 1) * step - self.group.blocks_needed(self.block_size) <= i

    def hit_table(self, keys: list[bytes], hit: int) -> list[int]:
        """The table a hit of `hit` blocks starts with: the cached blocks it reuses, a
        sliding group's blocks out of its window's reach `DROPPED`."""
        need = self.group.blocks_needed(self.block_size)
        first = 0 if need is None else max(0, hit - need)
        block_of = self.index.block_of if self.index is not None else {}
        return [DROPPED] * first + [block_of[keys[i]] for i in range(first, hit)]

    def check_table(self, seq: Sequence, table: list[int]) -> None:
        """Its tokens are in its blocks; only a window drops, and only what it no longer
        reaches."""
        rid = seq.request_id
        require(seq.num_computed <= len(table) * self.block_size,
                f"request {rid} has tokens outside {self.label}'s blocks")  # fmt: skip
        reach = 0  # blocks before this one may be dropped
        if self.group.window is not None:
            reach = self.retention.recent_start(seq.num_computed, self.group.window - 1)
        dropped = [i for i, block in enumerate(table) if block == DROPPED]
        require(all(i < reach for i in dropped),
                f"{self.label} dropped a block request {rid} still reads")  # fmt: skip

    def peak_blocks(self, seq: Sequence) -> int:
        """Most blocks `seq` holds at once in this group: all of them in a full group; a
        window's reach, the tail and its prompt's blocks in a sliding one."""
        blocks = worst_case_blocks(self, seq)
        need = self.group.blocks_needed(self.block_size)
        if need is None:
            return blocks
        return min(blocks, need + 1 + ceil_div(len(seq.prompt_ids), self.block_size))


@CACHES.register("hybrid")
class HybridCache(KVCache):
    shares_prefixes = forks = emits_events = True
    admissions = ("watermark",)  # vLLM's; reserve would promise every group's worst case

    def __init__(
        self,
        pool: KVPool,
        block_size: int,
        max_model_len: int,
        groups: list[KVCacheGroup],
        indexes: list | None = None,
        poison_freed: bool = False,
        watermark: float = 0.01,
        retention_interval: int | None = None,
    ):
        """`groups`: the model's KV cache groups (kvlab.cache.groups.kv_cache_groups); the
        pool holds as many layers as the largest group. `indexes`: each group's prefix
        index (None: no prefix caching); `retention_interval`:
        EngineConfig.prefix_cache_retention_interval."""
        super().__init__(pool, block_size, max_model_len, poison_freed)
        self.groups = groups
        self.allocator = BlockAllocator(self.num_blocks, on_evict=self._evict)
        self.watermark_blocks = int(watermark * self.num_blocks)
        self.parts = [
            GroupTables(
                group,
                pool,
                block_size,
                max_model_len,
                poison_freed,
                index,
                self.allocator,
                retention_interval,
            )  # fmt: skip
            for group, index in zip(groups, indexes or [None] * len(groups))
        ]

    @classmethod
    def slot_unit(cls, config, max_model_len: int) -> tuple[str, int]:
        return "block_size", config.block_size

    @classmethod
    def from_config(cls, config, pool: KVPool, max_model_len: int, events=None, groups=None):
        """`events`: a sink for the indexes' KV events, each tagged with its group."""
        if events is not None and not config.prefix_caching:
            raise ValueError("KV events need prefix caching: set prefix_caching='hash'")
        indexes = config.prefix_caching and [
            PREFIX_INDEXES[config.prefix_caching].from_config(config, _tagging(events, g))
            for g in range(len(groups))
        ]
        return cls(pool, config.block_size, max_model_len, groups, indexes or None,
                   config.poison_freed, config.watermark,
                   config.prefix_cache_retention_interval)  # fmt: skip

    @property
    def index(self):
        """The first group's prefix index (sessions forget prefixes through every group's)."""
        return self.parts[0].index

    # --- admission -----------------------------------------------------------------
    def check_fits(self, seq: Sequence) -> None:
        need = sum(part.peak_blocks(seq) for part in self.parts)
        if need > self.num_blocks:
            raise ValueError(
                f"request needs {need} blocks of {self.block_size} tokens over its "
                f"{len(self.parts)} KV cache groups (prompt {len(seq.prompt_ids)} + "
                f"max_new_tokens {seq.params.max_new_tokens}) but the KV budget holds only "
                f"{self.num_blocks} blocks"
            )

    def prefix_hit(self, seq: Sequence) -> tuple[int, list[bytes]]:
        """(blocks every group can serve of `seq`'s prompt, the prompt's chained keys)."""
        if self.index is None or seq.num_computed:
            return 0, []
        keys = self.index.keys(seq.prompt_ids, seq.salt)
        limit = self._limit(seq, keys)
        return cross_group_hit(self.groups, self._held(keys), limit, self.block_size), keys

    def _held(self, keys: list[bytes]):
        """cached(g, i): whether group g's index holds prompt block i."""
        indexes = [part.index.block_of for part in self.parts]
        return lambda g, i: keys[i] in indexes[g]

    def _limit(self, seq: Sequence, keys: list[bytes]) -> int:
        """The most blocks a hit may take: the prompt's last token always runs."""
        return min((len(seq.prompt_ids) - 1) // self.block_size, len(keys))

    def _plan(self, seq: Sequence, alone: bool, chunk: int | None) -> tuple | None:
        """(every group's first table (its hit), the prompt's keys), if their first step's
        blocks fit."""
        hit, keys = self.prefix_hit(seq)
        tables = [part.hit_table(keys, hit) for part in self.parts]
        end = tokens_after_first_step(seq, hit * self.block_size, chunk)
        need = sum(ceil_div(end, self.block_size) - len(table) for table in tables)
        reused = {b for table in tables for b in table if b != DROPPED}
        pinned = sum(1 for b in reused if b in self.allocator.cached)
        headroom = 0 if alone else self.watermark_blocks
        fits = need <= self.allocator.num_available - pinned - headroom
        return (tables, keys) if fits else None

    def _allocate(self, seq: Sequence, plan: tuple, chunk: int | None) -> None:
        tables, keys = plan
        hit = len(tables[0]) * self.block_size
        for part, table in zip(self.parts, tables):
            for block in table:
                if block != DROPPED:
                    self.allocator.incref(block)
            part.tables[seq.request_id] = list(table)
            part.sequences[seq.request_id] = seq
        if self.index is not None:
            seq.notes.append(self._explain(seq, hit, keys))
        seq.num_computed = seq.prefix_hit_tokens = hit

    def _explain(self, seq: Sequence, hit: int, keys: list[bytes]) -> Note:
        """How much of the prompt hit, and what each group alone would have served: the
        group that holds least is the one that set the hit."""
        held, limit, bs = self._held(keys), self._limit(seq, keys), self.block_size
        alone = [
            cross_group_hit([group], lambda _, i, g=g: held(g, i), limit, bs) * bs
            for g, group in enumerate(self.groups)
        ]
        each = ", ".join(
            f"{g} ({'full' if group.window is None else f'window {group.window}'}) {tokens}"
            for g, (group, tokens) in enumerate(zip(self.groups, alone))
        )
        text = (f"prefix cache: {hit} of {len(seq.prompt_ids)} prompt tokens hit in every "
                f"KV cache group; each group alone holds: {each}")  # fmt: skip
        return Note("prefix", "hit" if hit else "miss", text)

    # --- growth, release, sharing ----------------------------------------------------
    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        return sum(part.blocks_needed(seq, num_tokens) for part in self.parts)

    def ensure_capacity(self, seq: Sequence, num_tokens: int) -> None:
        for part in self.parts:
            part.ensure_capacity(seq, num_tokens)

    def retain(self, seq: Sequence) -> None:
        for part in self.parts:
            part.retain(seq)

    def publish(self, seq: Sequence, upto: int | None = None) -> None:
        for part in self.parts:
            part.publish(seq, upto)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        for part in self.parts:
            part.fork(parent, child)
        self.sequences[child.request_id] = child

    def _release(self, seq: Sequence) -> list[int]:
        freed = []
        for part in self.parts:
            part.sequences.pop(seq.request_id)
            freed += part._release(seq)
        return freed

    def _trim(self, seq: Sequence) -> list[int]:
        return [block for part in self.parts for block in part._trim(seq)]

    def _evict(self, block: int) -> None:
        """The LRU evicts a cached block: the group whose index holds it forgets it."""
        for part in self.parts:
            if part.sharing.indexed(block):
                part.sharing.forget(block)

    def reset_prefix_cache(self) -> bool:
        if self.allocator.num_used:
            return False
        return all([part.reset_prefix_cache() for part in self.parts])

    def forget_prefixes(self, prefixes: list[tuple], keep: set[bytes]) -> dict[str, int]:
        return {"device": sum(part.sharing.drop_prefixes(prefixes, keep)[0] for part in self.parts)}

    # --- accounting ----------------------------------------------------------------
    def block_table(self, seq: Sequence) -> list[int]:
        """The first group's table (a full group's, where the model has one)."""
        return self.parts[0].tables[seq.request_id]

    def group_tables(self, seq: Sequence) -> list[list[int]]:
        return [part.tables[seq.request_id] for part in self.parts]

    @property
    def num_available(self) -> int:
        return self.allocator.num_available

    def reserved_slots(self) -> int:
        return self.allocator.num_used * self.block_size

    def live_tokens(self) -> int:
        """Tokens stored in referenced blocks over every group (a token of a sequence
        counts once per group that keeps it: each holds its own layers' K/V)."""
        return sum(part.live_tokens() for part in self.parts)

    def group_blocks(self) -> list[int]:
        """Blocks each group's tables reference now (each shared block once)."""
        return [
            len({b for table in part.tables.values() for b in table if b != DROPPED})
            for part in self.parts
        ]

    def block_owners(self) -> list[int]:
        owners = [-1] * self.num_blocks
        for part in self.parts:
            for block, owner in enumerate(part.block_owners()):
                if owner != -1:
                    owners[block] = owner if owners[block] == -1 else -2
        return owners

    def check_integrity(self) -> None:
        self.allocator.check_integrity()
        counts = [0] * self.num_blocks
        for part in self.parts:
            require(set(part.tables) == set(self.sequences), f"{part.label}'s tables != admitted")
            for request_id, table in part.tables.items():
                part.check_table(self.sequences[request_id], table)
                for block in table:
                    counts[block] += block != DROPPED
        require(counts == self.allocator.ref_counts, "reference counts != table references")
        for block in self.allocator.cached:
            owners = sum(part.sharing.indexed(block) for part in self.parts)
            require(owners == 1, f"cached block {block} is in {owners} groups' indexes")
        for block in self.allocator.free_blocks:
            indexed = any(part.sharing.indexed(block) for part in self.parts)
            require(not indexed, f"free block {block} is in a prefix index")


def _tagging(events, group: int):
    """A sink that hands `events` each event tagged with `group` (None without events)."""
    return None if events is None else (lambda event: events(_tagged(event, group)))


def _tagged(event, group: int):
    """`event` carrying its group (vLLM's BlockStored.group_idx); a reset has none."""
    if isinstance(event, AllBlocksCleared):
        return event
    return dataclasses.replace(event, group_idx=group)
