"""Which sequences run in the next step, and how many tokens each.

The scheduler owns three queues: `waiting` (new and recompute-preempted requests, by
priority then arrival), `running` (their KV is in the cache) and `swapped` (their KV sits
in host memory, or arrived from another engine's prefill: kvlab.disagg). Each step it
builds one batch within the token budget, and schedules every sequence at most once:

- without chunked prefill, a step is either a prefill (whole prompts of newly admitted
  requests) or a decode (one token for every running sequence, within the budget);
- with chunked prefill, a step mixes decodes and prompt chunks, in the configured order
  (decode-first keeps running streams flowing while a long prompt arrives). The decodes
  are the sequences that were decoding when the step began: a request admitted in this
  step is prefilled, never also decoded.

Before a batch runs, every sequence in it gets the blocks it needs. When the free list
runs dry (watermark admission), a victim is preempted: the running request of lowest
priority, then the most recently admitted, whether or not this step already holds its row
(a victim's row leaves the step and its tokens go back to the budget, as in vLLM V1). It
is recomputed or swapped back later and continues exactly where it stopped. Swapped
requests come back before anyone new is admitted, and admission is head-of-line: nobody
jumps the queue.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvlab.cache.base import KVCache
from kvlab.cache.connector import KVConnector
from kvlab.config import EngineConfig
from kvlab.integrity import require
from kvlab.sequence import Note, RequestState, Sequence

Row = tuple[Sequence, int]  # a sequence and the tokens it computes this step


@dataclass
class Batch:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # per sequence: a prompt (chunk), or 1 + drafts in decode
    phase: str = ""  # "prefill" | "decode" | "mixed", fixed when the batch is built
    admitted: list[Sequence] = field(default_factory=list)  # started their prompt this step

    def __post_init__(self) -> None:
        if not self.phase:
            decode = [is_decode(s, n) for s, n in self]
            self.phase = "decode" if all(decode) else "prefill" if not any(decode) else "mixed"

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def subset(self, rows: list[int], num_new_tokens: list[int] | None = None) -> Batch:
        """The batch of rows `rows` only (kvlab.engine.isolation runs a batch in parts),
        with their own token counts unless `num_new_tokens` gives others."""
        seqs = [self.seqs[i] for i in rows]
        counts = num_new_tokens or [self.num_new_tokens[i] for i in rows]
        admitted = [s for s in self.admitted if any(s is t for t in seqs)]
        return Batch(seqs, counts, admitted=admitted)

    def __iter__(self):
        return iter(zip(self.seqs, self.num_new_tokens))


def is_decode(seq: Sequence, num_new: int) -> bool:
    """The sequence's own last sampled token, and any drafts after it (not prompt tokens)."""
    return seq.num_pending == 1 and bool(seq.output_ids)


@dataclass(frozen=True)
class Event:
    """A request entered a state (at `time_s` on the engine clock)."""

    time_s: float
    request_id: int
    state: RequestState


def queue_key(seq: Sequence) -> tuple:
    return (-seq.priority, seq.arrival_s, seq.request_id)  # higher priority first


def victim_key(seq: Sequence) -> tuple:
    """The running sequence with the largest key is preempted first: lowest priority, then
    the most recently admitted (so the oldest keeps progressing)."""
    return (-seq.priority, seq.admit_order)


def choose_victim(running: list[Sequence]) -> Sequence:
    """The preemption victim among `running` (see `victim_key`)."""
    return max(running, key=victim_key)


def _cause(seq: Sequence, n: int, need: int, free: int, victim: Sequence, running: int) -> Note:
    """Why `victim` is preempted: `seq` needs `need` blocks for its next `n` tokens."""
    chose = (
        "itself, as no running request ranks below it"
        if victim is seq
        else f"request {victim.request_id} (priority {victim.priority}, admission "
        f"#{victim.admit_order})"
    )
    text = (
        f"request {seq.request_id} needed {need} block(s) for its next {n} token(s) and "
        f"{free} were free; among {running} running, the victim rule (lowest priority, then "
        f"most recently admitted) chose {chose}"
    )
    return Note("preemption", "out of blocks", text)


def seats(seq: Sequence) -> int:
    """Running slots a request takes once admitted: all n samples of an unforked one."""
    return seq.params.n if seq.parent_id is None and seq.first_token_s is None else 1


class Scheduler:
    def __init__(self, config: EngineConfig, cache: KVCache):
        self.config, self.cache = config, cache
        self.waiting: list[Sequence] = []  # sorted by queue_key
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []  # sorted by queue_key
        self.swap_space: dict[int, object] = {}  # request id -> its KV in host memory
        self.arrivals: dict[int, KVConnector] = {}  # request id -> the connector
        # its KV arrives through (another engine prefilled it)
        self.events: list[Event] = []
        self.preemptions = self.swapped_bytes = self.recomputed_tokens = 0
        self.swap_in_s = 0.0  # seconds spent copying swapped-out KV back into the pool
        self.batch_open = True  # static batching: admit only until the batch starts decoding
        self._admissions = 0
        self._fresh: list[Sequence] = []  # admitted by the schedule() in progress
        self._now = 0.0
        # The preemption victim rule: kvlab's own; a lab's capstone plugs a learner's in
        # here (kvlab.labs.capstone) before the engine serves its first request.
        self.choose_victim: Callable[[list[Sequence]], Sequence] = choose_victim

    # --- queues --------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        bisect.insort(self.waiting, seq, key=queue_key)
        self.events.append(Event(seq.arrival_s, seq.request_id, RequestState.WAITING))

    def adopt(self, seq: Sequence) -> None:
        """A sequence the cache admitted outside the queue (an n > 1 fork) joins `running`.

        Its seat was counted when its parent was admitted (`seats`)."""
        seq.status = RequestState.RUNNING
        seq.admit_order = self._next_admission()
        self.running.append(seq)
        self.events.append(Event(self._now, seq.request_id, RequestState.RUNNING))

    def add_arrived(self, seq: Sequence, connector: KVConnector) -> None:
        """A request whose KV arrived from elsewhere (another engine's prefill) waits in
        `swapped`, and is swapped in like a preempted one: the cache allocates its blocks
        and `connector` loads its KV into them."""
        seq.status = RequestState.SWAPPED
        self.arrivals[seq.request_id] = connector
        bisect.insort(self.swapped, seq, key=queue_key)
        self.events.append(Event(self._now, seq.request_id, RequestState.SWAPPED))

    def next_arrival(self) -> float | None:
        return min((s.arrival_s for s in self.waiting), default=None)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def finish(
        self, seq: Sequence, state: RequestState = RequestState.FINISHED, now: float | None = None
    ) -> None:
        """Retire a sequence (finished or cancelled) and free its KV memory at once."""
        if seq in self.running:
            self.running.remove(seq)
            self.cache.free(seq)
        elif seq in self.swapped:
            self.swapped.remove(seq)
            if seq.request_id in self.arrivals:  # its KV never loaded
                self.arrivals.pop(seq.request_id).request_finished(seq, [])
            else:
                del self.swap_space[seq.request_id]
                self.cache.drop_swapped(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = state
        self.events.append(Event(self._now if now is None else now, seq.request_id, state))

    # --- the step's batch ----------------------------------------------------------
    def schedule(self, now: float) -> Batch | None:
        """The next step's batch (its blocks already secured), or None if nothing can run."""
        self._now = now
        if not self.running and not self.swapped:
            self.batch_open = True  # static batching: the previous batch is done
        self._swap_in()  # swapped requests belong to the batch that runs
        admitting = (self.config.batching == "continuous" or self.batch_open) and not (self.swapped)
        budget = self.config.max_num_batched_tokens
        decoding = [s for s in self._by_priority(self.running) if s.num_pending == 1]
        admitted = self._fresh = []
        if not self.config.chunked_prefill:
            rows = self._prefills(now, budget, admitting, admitted, whole=True)
            rows = rows or self._decodes(decoding, budget)
        elif self.config.schedule_order == "decode-first":
            rows = self._decodes(decoding, budget)
            rows += self._prefills(now, budget - sum(n for _, n in rows), admitting, admitted)
        else:
            rows = self._prefills(now, budget, admitting, admitted)
            rows += self._decodes(decoding, budget - sum(n for _, n in rows))
        rows = self._refill(self._secure_blocks(rows), decoding, budget)
        if not rows:
            return None
        self._check_rows(rows)
        for seq, n in rows:  # full blocks filled by this step (decodes, later chunks)
            self._publish(seq, min(n, seq.num_pending))  # drafts are never published
        batch = Batch([s for s, _ in rows], [n for _, n in rows])
        batch.admitted = [s for s in admitted if s in batch.seqs]
        if batch.phase != "prefill":
            self.batch_open = False
        return batch

    def _refill(self, rows: list[Row], decoding: list[Sequence], budget: int) -> list[Row]:
        """`rows`, and decodes for the tokens that rows preempted while securing blocks
        gave back.

        A prompt chunk may take the whole budget and then preempt itself for blocks: the
        decodes it crowded out run instead (a step never idles while a decode can run).
        Without chunked prefill a step mixes nothing: decodes run only if no prompt did."""
        if rows and not self.config.chunked_prefill:
            return rows
        while True:
            # A refill decode that needs blocks preempts by the victim rule over every
            # running sequence, this step's rows included (as vLLM V1's scheduler does
            # for a running request it cannot allocate): sparing the rows would let a
            # low-priority chunk outrank a high-priority decode. A row whose sequence is
            # preempted leaves the step, and its tokens go back to the budget for the
            # decodes still left; each pass schedules or preempts at least one of them.
            running = {id(seq) for seq in self.running}
            rows = [(seq, n) for seq, n in rows if id(seq) in running]
            scheduled = {id(seq) for seq, _ in rows}
            left = [s for s in decoding if id(s) in running and id(s) not in scheduled]
            spare = budget - sum(n for _, n in rows)
            if not left or spare <= 0:
                return rows
            rows += self._secure_blocks(self._decodes(left, spare))

    def _check_rows(self, rows: list[Row]) -> None:
        """A step holds each row's sequence once, and only while it runs: a sequence
        preempted while the step was built has left it (its table is gone)."""
        running = {id(seq) for seq in self.running}
        ids = [id(seq) for seq, _ in rows]
        require(
            set(ids) <= running,
            "a step holds a row whose sequence was preempted while the step was built",
        )
        require(len(set(ids)) == len(ids), "a step holds one sequence in two rows")

    def _by_priority(self, seqs: list[Sequence]) -> list[Sequence]:
        return sorted(seqs, key=victim_key)

    @staticmethod
    def _decodes(decoding: list[Sequence], budget: int) -> list[Row]:
        """One token per decoding sequence, plus the drafts it carries (speculative
        decoding) while the budget lasts; the budget cuts drafts before decodes."""
        chosen = decoding[: max(budget, 0)]
        spare = max(budget, 0) - len(chosen)  # tokens left beyond one per decode
        rows: list[Row] = []
        for seq in chosen:
            seq.spec_room = min(seq.spec_room, spare)
            spare -= seq.spec_room
            rows.append((seq, 1 + seq.spec_room))
        return rows

    def _prefills(
        self,
        now: float,
        budget: int,
        admitting: bool,
        admitted: list[Sequence],
        whole: bool = False,
    ) -> list[Row]:
        """Prompt work: running prompts part-way in first, then new admissions. `whole`
        (no chunked prefill): each prompt in one piece; the first may exceed the budget."""
        rows: list[Row] = []
        for seq in self._by_priority(self.running):
            if seq.num_pending <= 1:
                continue
            n = seq.num_pending if whole else min(seq.num_pending, budget)
            if budget <= 0 or (whole and rows and n > budget):
                break
            rows.append((seq, n))
            budget -= n
        if admitting:
            rows += self._admit(now, budget, admitted, whole, must_fit=bool(rows))
        return rows

    def _admit(
        self, now: float, budget: int, admitted: list[Sequence], whole: bool, must_fit: bool
    ) -> list[Row]:
        """Admit from the head of the queue while memory, seats and the budget allow.

        Whole prompts: the first may exceed the budget unless `must_fit` (it then runs
        alone); later ones wait for a step of their own."""
        rows: list[Row] = []
        for seq in [s for s in self.waiting if s.arrival_s <= now]:
            if self._seats_taken() + seats(seq) > self.config.max_num_seqs or budget <= 0:
                break
            if whole and (rows or must_fit) and seq.num_pending > budget:
                break
            alone, first = not self.running, None if whole else budget
            if self.cache.allocate_slots(seq, first, alone) is None:
                break
            self.waiting.remove(seq)
            seq.status = RequestState.RUNNING
            seq.admit_order = self._next_admission()
            self._resume(seq)
            self.running.append(seq)
            admitted.append(seq)
            chunk = seq.num_pending if whole else min(seq.num_pending, budget)
            self._publish_ahead(seq, chunk)
            rows.append((seq, chunk))
            budget -= chunk
        return rows

    def _publish_ahead(self, seq: Sequence, chunk: int) -> None:
        """Publish an admitted prompt's blocks for this step at once, as vLLM V1 does: a
        request admitted later in the same step shares them. The forward writes every
        row's K/V of a layer before any row's attention reads that layer."""
        self._publish(seq, chunk)

    def _publish(self, seq: Sequence, num_new: int) -> None:
        """Offer the full blocks `seq` holds once this step's tokens are in, for reuse."""
        if self.cache.shares_prefixes:
            self.cache.publish(seq, seq.num_computed + num_new)

    def _seats_taken(self) -> int:
        return sum(seats(s) for s in self.running)

    def _next_admission(self) -> int:
        self._admissions += 1
        return self._admissions

    def _resume(self, seq: Sequence) -> None:
        if seq.preempted_at is not None:
            seq.stall_s += self._now - seq.preempted_at
            seq.preempted_at = None
        self.events.append(Event(self._now, seq.request_id, RequestState.RUNNING))

    # --- memory ----------------------------------------------------------------------
    def _secure_blocks(self, rows: list[Row]) -> list[Row]:
        """Give every row the blocks it needs, preempting victims while there are none."""
        kept = []
        for seq, n in sorted(rows, key=lambda row: victim_key(row[0])):
            if seq not in self.running:
                continue  # preempted for an earlier row
            while self.cache.allocate_slots(seq, n) is None:
                need = self.cache.blocks_needed(seq, seq.num_computed + n)
                free, victim = self.cache.num_available, self.choose_victim(self.running)
                self.preempt(victim, _cause(seq, n, need, free, victim, len(self.running)))
                if victim is seq:
                    break
            if seq in self.running:
                kept.append((seq, n))
        order = {id(seq): i for i, (seq, _) in enumerate(rows)}
        return sorted(kept, key=lambda row: order[id(row[0])])

    def preempt(self, victim: Sequence, cause: Note | None = None) -> None:
        """Take a running sequence's blocks away; it resumes exactly where it stopped.
        `cause` says why, on the victim's notes (default: preempted by hand)."""
        self.running.remove(victim)
        victim.draft_ids, victim.spec_room = [], 0
        self.preemptions += 1
        victim.preemptions += 1
        victim.preempted_at = self._now
        # A request admitted in this very step is requeued, never swapped: its blocks may
        # hold prefix hits on blocks published for this step but not yet computed.
        fresh = any(victim is seq for seq in self._fresh)
        swap = self.config.preemption == "swap" and self.cache.swaps  # naive: recompute
        if swap and victim.num_computed and not fresh:
            saved = self.cache.swap_out(victim)
            self.swap_space[victim.request_id] = saved
            self.swapped_bytes += saved.nbytes
            bisect.insort(self.swapped, victim, key=queue_key)
            victim.status = RequestState.SWAPPED
        else:
            self.cache.free(victim)
            self.recomputed_tokens += victim.num_computed
            victim.num_computed = victim.prefix_hit_tokens = 0
            bisect.insort(self.waiting, victim, key=queue_key)
            victim.status = RequestState.PREEMPTED
        cause = cause or Note("preemption", "by hand", "preempted by a call to Scheduler.preempt")
        how = "swapped out" if victim.status is RequestState.SWAPPED else "dropped, to recompute"
        victim.notes.append(
            Note(cause.kind, cause.label, f"at t={self._now:.3f} s {how}: {cause.text}")
        )
        self.events.append(Event(self._now, victim.request_id, victim.status))

    def _swap_in(self) -> None:
        while self.swapped:
            seq = self.swapped[0]
            if self._seats_taken() + seats(seq) > self.config.max_num_seqs:
                break
            if self.cache.allocate_computed(seq, alone=not self.running) is None:
                break
            self.swapped.pop(0)
            if seq.request_id in self.arrivals:
                self.arrivals.pop(seq.request_id).load(seq)
            else:
                started = time.perf_counter()
                self.cache.swap_in(seq, self.swap_space.pop(seq.request_id))
                self.swap_in_s += time.perf_counter() - started
            seq.status = RequestState.RUNNING
            self._resume(seq)
            self.running.append(seq)
