"""Which sequences run in the next step, and how many tokens each.

A step is either a prefill (newly admitted prompts) or a decode (one token for every
running sequence). Admission is first come, first served: the head of the queue waits
until the cache can take it, and nobody jumps ahead of it.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass

from kvlab.cache.base import KVCache
from kvlab.config import EngineConfig
from kvlab.sequence import Sequence, SequenceStatus


@dataclass
class Batch:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # per sequence: its prompt in prefill, 1 in decode
    is_prefill: bool

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, config: EngineConfig, cache: KVCache):
        self.config, self.cache = config, cache
        self.waiting: deque[Sequence] = deque()  # sorted by arrival time
        self.running: list[Sequence] = []
        self.batch_open = True  # static batching: admit only until the batch starts decoding

    def add(self, seq: Sequence) -> None:
        arrivals = [s.arrival_s for s in self.waiting]
        self.waiting.insert(bisect.bisect_right(arrivals, seq.arrival_s), seq)

    def next_arrival(self) -> float | None:
        return self.waiting[0].arrival_s if self.waiting else None

    def schedule(self, now: float) -> Batch | None:
        """The next step's batch, or None when nothing can run at time `now`."""
        if self.config.batching == "continuous" or self.batch_open:
            batch = self._admit(now)
            if batch is not None:
                return batch
        if not self.running:
            return None
        self.batch_open = False
        return Batch(list(self.running), [1] * len(self.running), is_prefill=False)

    def _admit(self, now: float) -> Batch | None:
        admitted, tokens = [], 0
        while self.waiting and len(self.running) + len(admitted) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.arrival_s > now:
                break
            if admitted and tokens + seq.num_pending > self.config.max_prefill_tokens:
                break
            if not self.cache.can_admit(seq):
                break
            self.waiting.popleft()
            self.cache.admit(seq)
            seq.status = SequenceStatus.RUNNING
            admitted.append(seq)
            tokens += seq.num_pending
        if not admitted:
            return None
        self.running.extend(admitted)
        return Batch(admitted, [s.num_pending for s in admitted], is_prefill=True)

    def adopt(self, seq: Sequence) -> None:
        """A sequence the cache admitted outside the queue (an n > 1 fork) joins `running`."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Retire a finished sequence and free its KV memory at once."""
        self.running.remove(seq)
        self.cache.free(seq)
        seq.status = SequenceStatus.FINISHED
        if not self.running:
            self.batch_open = True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)
