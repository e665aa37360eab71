"""Which sequences run in the next step, and how many tokens each.

The scheduler owns three queues: `waiting` (new and recompute-preempted requests, by
priority then arrival), `running` (their KV is in the cache) and `swapped` (their KV sits
in host memory). Each step it builds one batch within the token budget:

- without chunked prefill, a step is either a prefill (whole prompts of newly admitted
  requests) or a decode (one token for every running sequence);
- with chunked prefill, a step mixes decodes and prompt chunks, in the configured order
  (decode-first keeps running streams flowing while a long prompt arrives).

Before a batch runs, every sequence in it gets the blocks it needs. When the free list
runs dry (watermark admission), a victim is preempted: the running request of lowest
priority, then the most recently admitted. It is recomputed or swapped back later and
continues exactly where it stopped. Admission is head-of-line: nobody jumps the queue.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from kvlab.cache.base import KVCache
from kvlab.config import EngineConfig
from kvlab.sequence import Sequence, SequenceStatus


@dataclass
class Batch:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # per sequence: a prompt (chunk), or 1 in decode

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def phase(self) -> str:
        decode = [bool(s.output_ids) and n == 1 == s.num_pending for s, n in self]
        return "decode" if all(decode) else "prefill" if not any(decode) else "mixed"

    def __iter__(self):
        return iter(zip(self.seqs, self.num_new_tokens))


@dataclass(frozen=True)
class Event:
    """A request changed state: waiting, running, preempted, swapped, finished, cancelled."""

    time_s: float
    request_id: int
    state: str


def queue_key(seq: Sequence) -> tuple:
    return (-seq.priority, seq.arrival_s, seq.request_id)  # higher priority first


class Scheduler:
    def __init__(self, config: EngineConfig, cache: KVCache):
        self.config, self.cache = config, cache
        self.waiting: list[Sequence] = []  # sorted by queue_key
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []  # sorted by queue_key
        self.swap_space: dict[int, object] = {}  # request id -> its KV in host memory
        self.events: list[Event] = []
        self.preemptions = self.swapped_bytes = self.recomputed_tokens = 0
        self.batch_open = True  # static batching: admit only until the batch starts decoding
        self._admissions = 0
        self._now = 0.0

    # --- queues --------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        bisect.insort(self.waiting, seq, key=queue_key)
        self.events.append(Event(seq.arrival_s, seq.request_id, "waiting"))

    def adopt(self, seq: Sequence) -> None:
        """A sequence the cache admitted outside the queue (an n > 1 fork) joins `running`."""
        seq.status = SequenceStatus.RUNNING
        seq.admit_order = self._next_admission()
        self.running.append(seq)
        self.events.append(Event(self._now, seq.request_id, "running"))

    def next_arrival(self) -> float | None:
        return min((s.arrival_s for s in self.waiting), default=None)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def finish(self, seq: Sequence, state: str = "finished", now: float | None = None) -> None:
        """Retire a sequence (finished or cancelled) and free its KV memory at once."""
        if seq in self.running:
            self.running.remove(seq)
            self.cache.free(seq)
        elif seq in self.swapped:
            self.swapped.remove(seq)
            del self.swap_space[seq.request_id]
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        self.events.append(Event(self._now if now is None else now, seq.request_id, state))
        if not self.running and not self.swapped:
            self.batch_open = True

    # --- the step's batch ----------------------------------------------------------
    def schedule(self, now: float) -> Batch | None:
        """The next step's batch (its blocks already secured), or None if nothing can run."""
        self._now = now
        admitting = self.config.batching == "continuous" or self.batch_open
        if admitting:
            self._swap_in()
        budget = self.config.max_num_batched_tokens
        if not self.config.chunked_prefill:
            prefill = self._admit(now, budget, whole=True) if admitting else []
            rows = prefill or [(s, s.num_pending) for s in self._by_priority(self.running)]
        elif self.config.schedule_order == "decode-first":
            rows = self._decodes(budget)
            rows += self._prefills(now, budget - len(rows), admitting)
        else:
            rows = self._prefills(now, budget, admitting)
            rows += self._decodes(budget - sum(n for _, n in rows))
        rows = self._secure_blocks(rows)
        if not rows:
            return None
        batch = Batch([s for s, _ in rows], [n for _, n in rows])
        if batch.phase != "prefill":
            self.batch_open = False
        return batch

    def _by_priority(self, seqs: list[Sequence]) -> list[Sequence]:
        return sorted(seqs, key=lambda s: (-s.priority, s.admit_order))

    def _decodes(self, budget: int) -> list[tuple[Sequence, int]]:
        ready = [s for s in self._by_priority(self.running) if s.num_pending == 1]
        return [(s, 1) for s in ready[: max(budget, 0)]]

    def _prefills(self, now: float, budget: int, admitting: bool) -> list[tuple[Sequence, int]]:
        rows = []
        for seq in self._by_priority(self.running):  # prompts already part-way in
            if seq.num_pending > 1 and budget > 0:
                rows.append((seq, min(seq.num_pending, budget)))
                budget -= rows[-1][1]
        return rows + (self._admit(now, budget, whole=False) if admitting else [])

    def _admit(self, now: float, budget: int, whole: bool) -> list[tuple[Sequence, int]]:
        """Admit from the head of the queue while memory, seats and the budget allow."""
        rows: list[tuple[Sequence, int]] = []
        for seq in [s for s in self.waiting if s.arrival_s <= now]:
            if len(self.running) >= self.config.max_num_seqs or budget <= 0:
                break
            if not self.cache.can_admit(seq):
                break
            if whole and rows and seq.num_pending > budget:
                break  # whole prompts: a long one waits for a step of its own
            self.waiting.remove(seq)
            self.cache.admit(seq)
            seq.status = SequenceStatus.RUNNING
            seq.admit_order = self._next_admission()
            self._resume(seq)
            self.running.append(seq)
            chunk = seq.num_pending if whole else min(seq.num_pending, budget)
            rows.append((seq, chunk))
            budget -= chunk
        return rows

    def _next_admission(self) -> int:
        self._admissions += 1
        return self._admissions

    def _resume(self, seq: Sequence) -> None:
        if seq.preempted_at is not None:
            seq.stall_s += self._now - seq.preempted_at
            seq.preempted_at = None
        self.events.append(Event(self._now, seq.request_id, "running"))

    # --- memory ----------------------------------------------------------------------
    def _secure_blocks(self, rows: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int]]:
        """Give every row the blocks it needs, preempting victims while there are none."""
        kept = []
        for seq, n in sorted(rows, key=lambda row: (-row[0].priority, row[0].admit_order)):
            if seq not in self.running:
                continue  # preempted for an earlier row
            while (
                self.cache.blocks_needed(seq, seq.num_computed + n) > self.cache.num_free_blocks()
            ):
                victim = max(self.running, key=lambda s: (-s.priority, s.admit_order))
                self.preempt(victim)
                if victim is seq:
                    break
            if seq in self.running:
                self.cache.ensure_capacity(seq, seq.num_computed + n)
                kept.append((seq, n))
        order = {id(seq): i for i, (seq, _) in enumerate(rows)}
        return sorted(kept, key=lambda row: order[id(row[0])])

    def preempt(self, victim: Sequence) -> None:
        """Take a running sequence's blocks away; it resumes exactly where it stopped."""
        self.running.remove(victim)
        self.preemptions += 1
        victim.preemptions += 1
        victim.preempted_at = self._now
        if self.config.preemption == "swap" and victim.num_computed:
            self.swap_space[victim.request_id] = self.cache.swap_out(victim)
            self.swapped_bytes += victim.num_computed * self.cache.pool.bytes_per_token
            bisect.insort(self.swapped, victim, key=queue_key)
            self.events.append(Event(self._now, victim.request_id, "swapped"))
        else:
            self.cache.free(victim)
            self.recomputed_tokens += victim.num_computed
            victim.num_computed = victim.prefix_hit_tokens = 0
            bisect.insort(self.waiting, victim, key=queue_key)
            self.events.append(Event(self._now, victim.request_id, "preempted"))
        victim.status = SequenceStatus.WAITING

    def _swap_in(self) -> None:
        while self.swapped and len(self.running) < self.config.max_num_seqs:
            seq = self.swapped[0]
            if not self.cache.can_swap_in(seq):
                break
            self.swapped.pop(0)
            self.cache.swap_in(seq, self.swap_space.pop(seq.request_id))
            seq.status = SequenceStatus.RUNNING
            self._resume(seq)
            self.running.append(seq)
