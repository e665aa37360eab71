"""The engine core: requests in, tokens out, one batched forward per step.

    engine = Engine(load_model(), EngineConfig(cache="paged"))       # kvlab.Engine
    outputs = engine.generate(["What is the capital of France?"], SamplingParams())

or, for continuous batching by hand: `add_request(...)`, then `step()` until
`has_unfinished()` is False. `kvlab.Engine` is this core with its parts built from a
config (kvlab.build); the core runs whatever parts it is given (kvlab.engine.parts).

A step is three calls, as in nano-vllm: the scheduler picks the batch, the runner
computes it (one forward for every row; a row that raises fails alone, see
isolation.py), and postprocess.py turns logits into tokens, with named hooks for
speculation, forks, retention and tiers. The engine's other faces live beside it:
requests.py (validation, cancel, sessions, explain) and batch_api.py (generate, run,
stats).
"""

from __future__ import annotations

import time

import torch

from kvlab.config import EngineConfig
from kvlab.engine.batch_api import BatchAPI
from kvlab.engine.isolation import group_of, run_isolated, tainted
from kvlab.engine.observers import StepObservers
from kvlab.engine.outputs import RequestOutput
from kvlab.engine.parts import EngineParts
from kvlab.engine.postprocess import Postprocess
from kvlab.engine.requests import RequestAPI
from kvlab.engine.scheduler import Batch, Scheduler
from kvlab.engine.sessions import Sessions
from kvlab.engine.telemetry import StepRecord, Telemetry
from kvlab.integrity import require
from kvlab.model.loading import LoadedModel
from kvlab.model.metadata import build_attention_metadata
from kvlab.sequence import Note


class EngineCore(RequestAPI, Postprocess, BatchAPI):
    """Serves requests on one model with the parts it is given."""

    def __init__(self, model: LoadedModel, config: EngineConfig, parts: EngineParts):
        self.model, self.config, self.parts = model, config, parts
        self.tokenizer = model.tokenizer
        self.runner, self.cache = parts.runner, parts.cache
        self.speculator, self.parallel = parts.speculator, parts.parallel
        self.max_model_len = parts.max_model_len
        self.scheduler = Scheduler(config, self.cache)
        self.sessions = Sessions(config.session_ttl_s)
        self.telemetry = Telemetry()
        self.observers = StepObservers()  # who watches the steps (observers.py)
        self.eos_ids = eos_ids(model)
        self.finished: list[RequestOutput] = []  # every finished request, in finish order
        self._next_id = 0
        self._groups: dict = {}  # n > 1: parent id -> all samples
        self._steps = 0
        self._start = time.perf_counter()

    def clock(self) -> float:
        """Seconds since the engine was created."""
        return time.perf_counter() - self._start

    def close(self) -> None:
        """Stop the engine's worker processes, if any (tensor parallel; also done at exit)."""
        self.parts.close()

    # --- the step ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step: schedule a batch, compute it, post-process what it computed; returns
        the requests that finished. Its observers (observers.py) see its named points."""
        self.observers.notify("before_schedule")
        now = self.clock()
        self._before_schedule(now)
        batch = self.scheduler.schedule(now)
        if batch is None:
            return self._idle(now)
        started = time.perf_counter()
        if self.speculator:
            self.speculator.leave_out(batch, self.scheduler.running)
        ran, logits, failed = run_isolated(self._compute, batch)  # a failing row fails alone
        finished = self._fail(ran, failed, now) if failed else []
        ran, logits = _still_running(ran, logits, self.scheduler.running)
        self.observers.notify("after_compute", ran, logits)
        finished += self._postprocess(ran, logits)
        self._record(batch if failed else ran, time.perf_counter() - started)
        self.observers.notify("after_step", finished)
        return finished

    def _before_schedule(self, now: float) -> None:
        """Sessions past their TTL end; tiers prefetch queued requests' blocks; speculation
        plans each decoding sequence's drafts."""
        self.sessions.expire(now, self.cancel, self.cache)
        connector = self.cache.connector
        if connector is not None and connector.stack.load.prefetch:
            connector.prefetch(self.scheduler.waiting, now)
        if self.speculator:
            self.speculator.plan(self.scheduler.running)

    def _compute(self, batch: Batch) -> list[torch.Tensor]:
        """The batch's drafts (speculation), then one forward for all its rows -> per row,
        logits (1, vocab) at its last new token, or (1 + drafts, vocab) at every token of
        a row carrying drafts."""
        if self.speculator:
            self.speculator.draft(batch)
        starts, ids, tables, wanted = [], [], [], []
        for seq, n in batch:  # the scheduler has already secured their blocks
            starts.append(seq.num_computed)
            ids.extend((seq.token_ids + seq.draft_ids)[seq.num_computed : seq.num_computed + n])
            tables.append(self.cache.group_tables(seq))  # one per KV cache group
            rows = n if seq.draft_ids else 1
            wanted.extend(range(len(ids) - rows, len(ids)))
        device = self.runner.device
        metas = [  # per KV cache group: where its layers write and read
            build_attention_metadata(
                starts, batch.num_new_tokens, [t[g] for t in tables], self.cache.block_size, device
            )
            for g in range(len(tables[0]))
        ]
        meta = metas[0] if len(metas) == 1 else metas
        input_ids = torch.tensor(ids, dtype=torch.long, device=device)
        at = torch.tensor(wanted, device=device) if len(wanted) > len(batch.seqs) else None
        logits = self.runner.forward(input_ids, meta, self.cache.pool, logits_at=at)
        return list(logits.split([n if s.draft_ids else 1 for s, n in batch]))

    def _fail(self, ran: Batch, failed: list, now: float) -> list[RequestOutput]:
        """Retire the requests whose rows failed alone (finish_reason "error"). Rows of
        `ran` that read blocks a failed row was to write this step are preempted first,
        to recompute."""
        for seq in tainted(self.cache, [seq for seq, _ in failed], ran.seqs):
            text = "a request it shares blocks with failed before writing them"
            self.scheduler.preempt(seq, Note("preemption", "shared a failed write", text))
        finished = []
        for seq, error in failed:
            finished += self._retire_request(group_of(seq), "error", now, error)
        self.finished.extend(finished)
        return finished

    def _idle(self, now: float) -> list[RequestOutput]:
        """Nothing ran: only requests that have not arrived yet may be the reason; wait
        for the next one (at most a second) when nothing else is in flight."""
        s = self.scheduler
        arrived = [seq for seq in s.waiting if seq.arrival_s <= now]
        require(
            not (arrived or s.running or s.swapped),
            f"the scheduler found nothing to run while {len(arrived)} requests wait, "
            f"{len(s.running)} run and {len(s.swapped)} are swapped out",
        )
        upcoming = s.next_arrival()
        if upcoming is not None:
            time.sleep(max(0.0, min(upcoming - self.clock(), 1.0)))
        return []

    def _record(self, batch: Batch, step_s: float) -> None:
        """One telemetry row for the step (and the block map, when recorded)."""
        memory, s = self.cache.memory(), self.scheduler
        self._steps += 1
        row = StepRecord(
            step=self._steps,
            time_s=self.clock(),
            phase=batch.phase,
            batch_seqs=len(batch.seqs),
            tokens=batch.num_tokens,
            running=len(s.running),
            waiting=len(s.waiting),
            swapped=len(s.swapped),
            preemptions=s.preemptions,
            swapped_bytes=s.swapped_bytes,
            recomputed_tokens=s.recomputed_tokens,
            blocks_used=self.cache.num_blocks - self.cache.num_available,
            blocks_free=self.cache.num_available,
            group_blocks=tuple(self.cache.group_blocks()),
            prefix_query_tokens=sum(len(seq.prompt_ids) for seq in batch.admitted),
            prefix_hit_tokens=sum(seq.prefix_hit_tokens for seq in batch.admitted),
            reserved_bytes=memory.reserved_bytes,
            live_bytes=memory.live_bytes,
            waste_bytes=memory.waste_bytes,
            budget_bytes=memory.budget_bytes,
            step_s=step_s,
        )
        owners = self.cache.block_owners() if self.config.record_block_map else None
        self.telemetry.record(row, owners)


def _still_running(ran: Batch, logits: list, running: list) -> tuple[Batch, list]:
    """The rows of `ran` (and their logits) whose sequence still runs after failures."""
    if all(seq in running for seq in ran.seqs):
        return ran, logits
    keep = [i for i, seq in enumerate(ran.seqs) if seq in running]
    return ran.subset(keep), [logits[i] for i in keep]


def eos_ids(model: LoadedModel) -> set[int]:
    """The token ids that end a sequence: the generation config's and the tokenizer's."""
    ids: set[int] = set()
    for source in (getattr(model.hf_model, "generation_config", None), model.tokenizer):
        value = getattr(source, "eos_token_id", None)
        if value is not None:
            ids.update([value] if isinstance(value, int) else value)
    return ids
