"""The paged cache: KV in fixed-size blocks, found through a per-sequence block table.

A sequence takes a new block only when its last block is full, so at most
block_size - 1 slots per sequence are ever unused (the tail of its last block).

Admission (until the scheduler can preempt): a request is admitted only if the blocks it
could ever need, ceil(min(prompt + max_new_tokens, max_model_len) / block_size), fit
beside what running sequences could still claim. Blocks are taken lazily, so memory is
only *held* as tokens arrive, but a running sequence can never run out of blocks.
"""

from __future__ import annotations

from kvlab.cache.base import KVCache
from kvlab.cache.block_allocator import BlockAllocator
from kvlab.cache.pool import KVPool
from kvlab.sequence import Sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)  # ceil division


class PagedCache(KVCache):
    name = "paged"

    def __init__(
        self, pool: KVPool, block_size: int, max_model_len: int, poison_freed: bool = False
    ):
        super().__init__(pool, block_size, max_model_len, poison_freed)
        self.allocator = BlockAllocator(self.num_blocks)
        self.tables: dict[int, list[int]] = {}  # request id -> block table
        self.promised: dict[int, int] = {}  # request id -> blocks it may still claim

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

    def can_admit(self, seq: Sequence) -> bool:
        outstanding = sum(self.promised.values())
        return self.worst_case_blocks(seq) <= self.allocator.num_free - outstanding

    def _allocate(self, seq: Sequence) -> None:
        self.tables[seq.request_id] = []
        self.promised[seq.request_id] = self.worst_case_blocks(seq)

    def ensure_capacity(self, seq: Sequence, num_tokens: int) -> None:
        table = self.tables[seq.request_id]
        while len(table) * self.block_size < num_tokens:
            table.append(self.allocator.allocate())
            self.promised[seq.request_id] -= 1

    def _release(self, seq: Sequence) -> list[int]:
        del self.promised[seq.request_id]
        table = self.tables.pop(seq.request_id)
        return [block for block in table if self.allocator.decref(block)]

    def block_table(self, seq: Sequence) -> list[int]:
        return self.tables[seq.request_id]

    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    def reserved_slots(self) -> int:
        return self.allocator.num_used * self.block_size

    def block_owners(self) -> list[int]:
        owners = [-1] * self.num_blocks
        for request_id, table in self.tables.items():
            for block in table:
                owners[block] = request_id
        return owners

    def check_integrity(self) -> None:
        self.allocator.check_integrity()
        counts = [0] * self.num_blocks
        for table in self.tables.values():
            for block in table:
                counts[block] += 1
        assert counts == self.allocator.ref_counts, "reference counts != table references"
        assert set(self.tables) == set(self.sequences), "block tables != admitted sequences"
        for request_id, seq in self.sequences.items():
            held = len(self.tables[request_id]) * self.block_size
            assert seq.num_computed <= held, f"request {request_id} has tokens outside its blocks"
            assert self.promised[request_id] >= 0, f"request {request_id} overdrew its promise"
        assert sum(self.promised.values()) <= self.allocator.num_free, "promised > free blocks"
