"""The engine: requests in, tokens out, one batched forward per step.

    engine = Engine(load_model(), EngineConfig(cache="naive"))
    outputs = engine.generate(["What is the capital of France?"], SamplingParams())

or, for continuous batching by hand: `add_request(...)`, then `step()` until
`has_unfinished()` is False.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import pandas as pd
import torch
from tqdm.auto import tqdm

from kvlab.cache import CACHES, make_cache
from kvlab.config import DEFAULT_MAX_MODEL_LEN, EngineConfig, SamplingParams
from kvlab.engine.isolation import describe, group_of, run_isolated, sample_isolated, tainted
from kvlab.engine.outputs import RequestMetrics, RequestOutput, Sample
from kvlab.engine.sampler import sample
from kvlab.engine.scheduler import Batch, Scheduler
from kvlab.engine.sequence import Note, RequestState, Sequence
from kvlab.engine.telemetry import StepRecord, Telemetry
from kvlab.integrity import EngineDead, require
from kvlab.model.loading import LoadedModel
from kvlab.model.metadata import build_attention_metadata
from kvlab.model.prompts import encode_prompt
from kvlab.model.runner import ModelRunner
from kvlab.sessions import SessionEnd, Sessions

if TYPE_CHECKING:
    from kvlab.workloads import Request

Prompt = str | list[int]


class Engine:
    """Serves requests on one model with one KV-cache variant."""

    def __init__(self, model: LoadedModel, config: EngineConfig | None = None):
        self.model = model
        self.config = config or EngineConfig()
        self.tokenizer = model.tokenizer
        self.parallel = None  # tensor_parallel_size > 1: the workers (kvlab.parallel)
        if self.config.tensor_parallel_size > 1:
            self.runner = self._start_tensor_parallel()
        else:
            self.runner = ModelRunner(model.hf_model)
        self.max_model_len = self._resolve_max_model_len()
        self.cache = make_cache(
            self.config,
            self.runner.kv_spec,
            self.runner.dtype,
            self.runner.device,
            self.max_model_len,
        )
        if self.parallel is not None:
            self.cache.pool = self.parallel.attach(self.cache.pool)
        if self.config.attention == "kernels":
            from kvlab.model.kernel_attention import KernelAttention

            self.runner.attention_fn = KernelAttention(self.cache.block_size)
        if self.config.batch_invariant:  # kvlab.model.invariant
            from kvlab.model.invariant import make_batch_invariant

            make_batch_invariant(self.runner, kernels=self.config.attention == "kernels")
        if getattr(self.cache, "retention", None) and self.cache.retention.observes_attention:
            from kvlab.cache.retention.scores import ScoredAttention  # H2O's statistics

            policy = self.cache.retention
            self.runner.attention_fn = ScoredAttention(
                self.runner.attention_fn, policy.scores, self.cache.block_size
            )
        self.scheduler = Scheduler(self.config, self.cache)
        self.speculator = None
        if self.config.speculative is not None:
            from kvlab.spec.speculator import Speculator

            self.speculator = Speculator(
                self.config.speculative,
                self.runner,
                self.cache,
                self.max_model_len,
                record=self.config.record_block_map,
            )
        self.telemetry = Telemetry()
        self.eos_ids = _eos_ids(model)
        self.finished: list[RequestOutput] = []  # every finished request, in finish order
        self._next_id = 0
        self._groups: dict[int, list[Sequence]] = {}  # n > 1: parent id -> all samples
        self._steps = 0
        self._start = time.perf_counter()
        self.sessions = Sessions(self.config.session_ttl_s)  # kvlab.sessions

    # --- set-up ------------------------------------------------------------------------
    def _start_tensor_parallel(self) -> ModelRunner:
        from kvlab.parallel import check_tensor_parallel
        from kvlab.parallel.worker import TensorParallel

        cfg = self.model.config
        tp = self.config.tensor_parallel_size
        check_tensor_parallel(tp, cfg.num_attention_heads, cfg.num_key_value_heads)
        self.parallel = TensorParallel(self.model, tp)
        weakref.finalize(self, self.parallel.close)
        return self.parallel.runner

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (also done at exit)."""
        if self.parallel is not None:
            self.parallel.close()

    def _resolve_max_model_len(self) -> int:
        cfg = self.model.config
        limit = cfg.max_position_embeddings
        if cfg.model_type == "mistral" and getattr(cfg, "sliding_window", None):
            limit = min(limit, cfg.sliding_window)  # kvlab attends to the full context
        wanted = self.config.max_model_len or min(limit, DEFAULT_MAX_MODEL_LEN)
        if wanted > limit:
            raise ValueError(f"EngineConfig.max_model_len={wanted} exceeds the model's {limit}")
        return wanted

    # --- requests ----------------------------------------------------------------------
    def clock(self) -> float:
        """Seconds since the engine was created."""
        return time.perf_counter() - self._start

    def encode(self, prompt: Prompt, chat: bool | None = None) -> list[int]:
        """Token ids of a prompt; strings get the chat template when the model has one."""
        if isinstance(prompt, str) and not prompt:
            raise ValueError("prompt is empty: give at least one character")
        if isinstance(prompt, str):
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as error:
                raise ValueError(
                    f"prompt is not valid text: {error.reason} at character {error.start} "
                    f"({prompt[error.start : error.end]!r})"
                ) from None
        ids = encode_prompt(self.tokenizer, prompt, chat)
        vocab = self.runner.embed.shape[0]
        if not ids:
            raise ValueError("prompt is empty: give at least one token id")
        if not isinstance(prompt, str) and (min(ids) < 0 or max(ids) >= vocab):
            raise ValueError(f"prompt token ids must lie in [0, {vocab}) (the vocabulary size)")
        return ids

    def make_sequence(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        chat: bool | None = None,
        arrival_s: float | None = None,
        salt: str | None = None,
        priority: int = 0,
        session: str | None = None,
    ) -> Sequence:
        """Validate a request and build its Sequence, without queueing it."""
        params = params or SamplingParams()
        if salt is not None and not isinstance(salt, str):
            raise ValueError(f"salt={salt!r} must be a string or None (a cache namespace)")
        if session is not None and not isinstance(session, str):
            raise ValueError(f"session={session!r} must be a string or None (a conversation)")
        ids = self.encode(prompt, chat)
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt of {len(ids)} tokens does not leave room for one new token within "
                f"max_model_len={self.max_model_len}"
            )
        if params.n > 1 and not self.cache.forks:
            forking = " or ".join(repr(n) for n, c in CACHES.items() if c.forks)
            raise ValueError(
                f"SamplingParams.n={params.n} > 1 needs EngineConfig(cache={forking}), a cache "
                f"whose sequences fork; cache={self.config.cache!r} does not"
            )
        if params.n > self.config.max_num_seqs:
            raise ValueError(
                f"SamplingParams.n={params.n} samples run at once, more than "
                f"EngineConfig.max_num_seqs={self.config.max_num_seqs}"
            )
        seq = self._new_sequence(ids, params, params.seed)
        seq.arrival_s = self.clock() if arrival_s is None else arrival_s
        seq.salt, seq.priority, seq.session = salt, priority, session
        self.cache.check_fits(seq)
        return seq

    def _new_sequence(self, ids: list[int], params: SamplingParams, seed: int | None) -> Sequence:
        generator = None
        if not params.greedy:
            generator = torch.Generator().manual_seed(seed if seed is not None else torch.seed())
        seq = Sequence(self._next_id, ids, params, generator=generator)
        self._next_id += 1
        return seq

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        chat: bool | None = None,
        arrival_s: float | None = None,
        salt: str | None = None,
        priority: int = 0,
        session: str | None = None,
    ) -> int:
        """Queue a request (raises ValueError for bad input, queuing nothing); returns its id.

        `salt` names a tenant / cache namespace: requests with different salts never share
        prefix-cached KV blocks. A higher `priority` is admitted first and preempted last.
        `session` names the conversation it belongs to (`end_session`, session_ttl_s).
        """
        seq = self.make_sequence(
            prompt, params, chat=chat, arrival_s=arrival_s, salt=salt, priority=priority,
            session=session,
        )  # fmt: skip
        return self.enqueue(seq)

    def enqueue(self, seq: Sequence) -> int:
        """Queue a sequence built by `make_sequence` (add_request is both in one call)."""
        self.scheduler.add(seq)
        self.sessions.on_add(seq, self.clock())
        return seq.request_id

    def samples(self, seq: Sequence) -> list[Sequence]:
        """Every sample of an unfinished request: `seq`, then (n > 1, once forked) its
        children, in sample order."""
        return self._groups.get(seq.request_id, [seq])

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- the step ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one batched forward (prefill or decode); return requests that finished."""
        now = self.clock()
        self._tier_and_session_work(now)
        if self.speculator:
            self.speculator.plan(self.scheduler.running)
        batch = self.scheduler.schedule(now)
        if batch is None:
            self._check_not_stalled(now)
            self._wait_for_arrival()
            return []
        started = time.perf_counter()
        if self.speculator:
            self.speculator.leave_out(batch, self.scheduler.running)
        ran, logits, failed = run_isolated(self._attempt, batch)  # a failing row fails alone
        if failed:
            ran, logits, finished = self._fail(ran, logits, failed, now)
        else:
            finished = []
        finished += self._advance(ran, logits)
        self._record(batch if failed else ran, time.perf_counter() - started)
        return finished

    def _attempt(self, batch: Batch) -> list[torch.Tensor]:
        """The step's work for `batch`: drafts (speculation), then the forward."""
        if self.speculator:
            self.speculator.draft(batch)
        return self._forward(batch)

    def _fail(self, ran: Batch, logits: list, failed: list, now: float):
        """Retire the requests whose rows failed alone (finish_reason "error"); rows of
        `ran` that read blocks a failed row was to write this step are preempted, to
        recompute. Returns the rows left to advance, their logits and what finished."""
        out = tainted(self.cache, [seq for seq, _ in failed], ran.seqs)
        for seq in out:
            text = "a request it shares blocks with failed before writing them"
            self.scheduler.preempt(seq, Note("preemption", "shared a failed write", text))
        finished = []
        for seq, error in failed:
            finished += self._retire_request(group_of(seq), "error", now, error)
        self.finished.extend(finished)
        keep = [i for i, s in enumerate(ran.seqs) if s in self.scheduler.running]
        return ran.subset(keep), [logits[i] for i in keep], finished

    def _forward(self, batch: Batch) -> list[torch.Tensor]:
        """One forward for the whole batch -> per row, logits (1, vocab) at its last new
        token, or (1 + drafts, vocab) at every token of a row carrying drafts."""
        starts, ids, tables, wanted = [], [], [], []
        for seq, n in batch:  # the scheduler has already secured their blocks
            start = seq.num_computed
            starts.append(start)
            ids.extend((seq.token_ids + seq.draft_ids)[start : start + n])
            tables.append(self.cache.block_table(seq))
            rows = n if seq.draft_ids else 1
            wanted.extend(range(len(ids) - rows, len(ids)))
        device = self.runner.device
        meta = build_attention_metadata(
            starts, batch.num_new_tokens, tables, self.cache.block_size, device
        )
        input_ids = torch.tensor(ids, dtype=torch.long, device=device)
        at = torch.tensor(wanted, device=device) if len(wanted) > len(batch.seqs) else None
        logits = self.runner.forward(input_ids, meta, self.cache.pool, logits_at=at)
        return list(logits.split([n if s.draft_ids else 1 for s, n in batch]))

    def _advance(self, batch: Batch, logits: list[torch.Tensor]) -> list[RequestOutput]:
        now, finished = self.clock(), []
        if not batch.seqs:  # every row failed
            return finished
        for seq, n in batch:
            seq.num_computed += n
        # A prompt chunk yields no token until the whole prompt is in the cache; a row
        # carrying drafts is verified first (kvlab.spec), the others sample one token.
        ready = [row for row, seq in enumerate(batch.seqs) if seq.num_pending <= 0]
        plain = [row for row in ready if not batch.seqs[row].draft_ids]
        sampled, failed = sample_isolated(
            sample,
            torch.cat([logits[row] for row in plain]) if plain else logits[0][:0],
            [batch.seqs[row] for row in plain],
        )
        tokens = {plain[i]: [token] for i, token in sampled.items()}
        for row in ready:
            seq = batch.seqs[row]
            speculated = bool(seq.draft_ids) or seq.spec_room > 0
            try:
                if seq.draft_ids:
                    tokens[row] = self.speculator.verify(seq, logits[row])
                members = [seq]
                if row in tokens and seq.first_token_s is None:
                    members += self._fork(seq, logits[row][-1])
            except EngineDead:
                raise
            except Exception as error:
                failed.append((seq, describe(error)))
            if row not in tokens or any(seq is f for f, _ in failed):
                if speculated:
                    self.speculator.rollback(seq)
                continue
            before = len(seq.output_ids)  # 0: this is the request's first token
            reason = self._emit(seq, tokens[row], now)
            if self.speculator and before:
                self.speculator.count_decode(len(seq.output_ids) - before)
            if speculated:
                self.speculator.rollback(seq)
            for member in members:
                member.first_token_s = member.first_token_s or now
                if member is not seq:
                    reason = self._finish_reason(member, member.output_ids[-1])
                if reason:
                    finished.extend(self._retire(member, reason, now))
        for seq, error in failed:  # sampling or verification raised for these alone
            finished += self._retire_request(group_of(seq), "error", now, error)
        for seq in self.scheduler.running:  # a retention policy may drop blocks now (forks
            self.cache.retain(seq)  # made this step included: they copied a whole table)
        self.finished.extend(finished)
        return finished

    def _emit(self, seq: Sequence, tokens: list[int], now: float) -> str | None:
        """Append a row's tokens (one, or verified drafts + one) up to the first that
        finishes the request; return the finish reason, if any."""
        for token in tokens:
            seq.output_ids.append(token)
            seq.token_times.append(now)
            reason = self._finish_reason(seq, token)
            if reason:
                return reason
        return None

    def _retire(
        self, seq: Sequence, reason: str, now: float, error: str | None = None
    ) -> list[RequestOutput]:
        seq.finish_s, seq.finish_reason, seq.error = now, reason, error
        seq.first_token_s = seq.first_token_s or now
        cancelled = reason == "cancelled"
        state = RequestState.CANCELLED if cancelled else RequestState.FINISHED
        self.scheduler.finish(seq, state, now)
        self.sessions.on_finish(seq, now)
        return self._complete(seq)

    def cancel(self, request_id: int) -> bool:
        """Stop a request (all its samples) now and free its blocks at once.

        Prefix-cached blocks go back to the LRU pool. Returns False if the request is not
        queued or running. Its output, with finish_reason "cancelled", lands in `finished`.
        """
        found = bool(self._members(request_id))
        self.finished.extend(self._retire_request(request_id, "cancelled", self.clock()))
        return found

    def _members(self, request_id: int) -> list[Sequence]:
        """The unfinished samples of a request, wherever they wait or run."""
        queues = self.scheduler.waiting + self.scheduler.running + self.scheduler.swapped
        return [s for s in queues if request_id in (s.request_id, s.parent_id)]

    def _retire_request(
        self, request_id: int, reason: str, now: float, error: str | None = None
    ) -> list[RequestOutput]:
        """Retire every unfinished sample of a request (cancelled, or failed with `error`)."""
        members = self._members(request_id)
        return [out for seq in members for out in self._retire(seq, reason, now, error)]

    # --- sessions and tiers (kvlab.sessions, kvlab.cache.tiers) -------------------------
    def end_session(self, session_id: str) -> SessionEnd:
        """End a conversation: cancel its unfinished requests and free its KV blocks on
        every tier (device cached blocks, host and disk copies), except blocks another
        live session also uses. Raises ValueError for an unknown session."""
        return self.sessions.end(self, session_id)

    def _tier_and_session_work(self, now: float) -> None:
        """Before a step: end sessions past their TTL; prefetch queued requests' blocks."""
        self.sessions.expire(self, now)
        connector = getattr(self.cache, "connector", None)
        if connector is not None and connector.stack.load.prefetch:
            connector.prefetch(self.scheduler.waiting, now)

    def explain(self, request_id: int) -> str:
        """What the engine did to a request and why, one line per event: how much of its
        prompt hit the prefix cache (and if not all, the reason it missed), and every
        preemption with its cause (who needed how many blocks, how many were free, the
        victim rule's choice). Raises ValueError for an unknown request id."""
        done = [out for out in self.finished if out.request_id == request_id]
        live = self._members(request_id)
        if not done and not live:
            raise ValueError(f"request_id={request_id} is neither queued, running nor finished")
        notes = done[0].notes if done else [n for s in live for n in s.notes]
        return "\n".join(n.text for n in notes) or (
            f"request {request_id}: nothing to explain (no prefix caching, never preempted)"
        )

    def _fork(self, parent: Sequence, logits: torch.Tensor) -> list[Sequence]:
        """n > 1: children that share the parent's prompt blocks, each with its first token."""
        children = []
        for i in range(1, parent.params.n):
            seed = None if parent.params.seed is None else parent.params.seed + i
            child = self._new_sequence(parent.prompt_ids, parent.params, seed)
            child.inherit(parent)
            child.output_ids.append(sample(logits[None], [child])[0])
            self.cache.fork(parent, child)
            self.scheduler.adopt(child)
            self.sessions.on_add(child, self.clock())
            children.append(child)
        self._groups[parent.request_id] = [parent, *children]
        return children

    def _complete(self, member: Sequence) -> list[RequestOutput]:
        """The request's output once every sample of it has finished."""
        group_id = member.request_id if member.parent_id is None else member.parent_id
        group = self._groups.get(group_id, [member])
        if not all(m.is_finished for m in group):
            return []
        self._groups.pop(group_id, None)
        return [self._output(group)]

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        if token in self.eos_ids and not seq.params.ignore_eos:
            return "eos"
        if len(seq.output_ids) >= seq.params.max_new_tokens:
            return "length"
        if seq.num_tokens >= self.max_model_len:
            return "max_model_len"
        return None

    def _check_not_stalled(self, now: float) -> None:
        """Nothing ran: only requests that have not arrived yet may be the reason."""
        s = self.scheduler
        arrived = [seq for seq in s.waiting if seq.arrival_s <= now]
        require(
            not (arrived or s.running or s.swapped),
            f"the scheduler found nothing to run while {len(arrived)} requests wait, "
            f"{len(s.running)} run and {len(s.swapped)} are swapped out",
        )

    def _wait_for_arrival(self) -> None:
        upcoming = self.scheduler.next_arrival()
        if upcoming is not None and not (self.scheduler.running or self.scheduler.swapped):
            time.sleep(max(0.0, min(upcoming - self.clock(), 1.0)))

    def _record(self, batch: Batch, step_s: float) -> None:
        memory = self.cache.memory()
        self._steps += 1
        self.telemetry.record(
            StepRecord(
                step=self._steps,
                time_s=self.clock(),
                phase=batch.phase,
                batch_seqs=len(batch.seqs),
                tokens=batch.num_tokens,
                running=len(self.scheduler.running),
                waiting=len(self.scheduler.waiting),
                swapped=len(self.scheduler.swapped),
                preemptions=self.scheduler.preemptions,
                swapped_bytes=self.scheduler.swapped_bytes,
                recomputed_tokens=self.scheduler.recomputed_tokens,
                blocks_used=self.cache.num_blocks - self.cache.num_available,
                blocks_free=self.cache.num_available,
                prefix_query_tokens=sum(len(s.prompt_ids) for s in batch.admitted),
                prefix_hit_tokens=sum(s.prefix_hit_tokens for s in batch.admitted),
                reserved_bytes=memory.reserved_bytes,
                live_bytes=memory.live_bytes,
                waste_bytes=memory.waste_bytes,
                budget_bytes=memory.budget_bytes,
                step_s=step_s,
            ),
            self.cache.block_owners() if self.config.record_block_map else None,
        )

    def _output(self, group: list[Sequence]) -> RequestOutput:
        samples = [
            Sample(
                list(m.output_ids),
                self.tokenizer.decode(m.output_ids, skip_special_tokens=True),
                m.finish_reason,
            )
            for m in group
        ]
        first = group[0]
        error = next((m.error for m in group if m.error), None)
        metrics = RequestMetrics(
            first.arrival_s,
            min(m.first_token_s for m in group),
            max(m.finish_s for m in group),
            len(first.output_ids),
            len(first.prompt_ids),
            first.prefix_hit_tokens,
            sum(m.preemptions for m in group),
            max(m.stall_s for m in group),
            tuple(first.token_times),
        )
        return RequestOutput(
            first.request_id,
            first.prompt_ids,
            samples[0].token_ids,
            samples[0].text,
            samples[0].finish_reason,
            metrics,
            samples,
            tuple(note for m in group for note in m.notes),
            error,
        )

    # --- batch API ---------------------------------------------------------------------
    def generate(
        self,
        prompts: Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        chat: bool | None = None,
        progress: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns one output per prompt, in order.

        All prompts are validated before any work starts: a bad one raises ValueError and
        nothing is queued.
        """
        if isinstance(prompts, str):
            raise TypeError("generate() takes a list of prompts; wrap a single prompt in [...]")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
        seqs = [self.make_sequence(p, sp, chat=chat) for p, sp in zip(prompts, sampling_params)]
        return self._drain(seqs, progress)

    def run(
        self, requests: Seq[Request], *, ignore_eos: bool = False, progress: bool = False
    ) -> list[RequestOutput]:
        """Serve a workload (kvlab.workloads): request i arrives `arrival_s` after the call.

        Returns one output per request, in order. All requests are validated first.
        `ignore_eos` makes every request produce exactly its max_new_tokens (benchmarks).
        """
        offset = self.clock()
        seqs = [
            self.make_sequence(
                r.prompt,
                SamplingParams(max_new_tokens=r.max_new_tokens, ignore_eos=ignore_eos),
                arrival_s=offset + r.arrival_s,
                salt=r.salt,
                priority=r.priority,
                session=r.session,
            )
            for r in requests
        ]
        return self._drain(seqs, progress)

    def _drain(self, seqs: list[Sequence], progress: bool) -> list[RequestOutput]:
        """Queue `seqs` and step until all of them are finished."""
        for seq in seqs:
            self.enqueue(seq)
        wanted = {seq.request_id: None for seq in seqs}
        total = sum(seq.params.max_new_tokens for seq in seqs)
        with tqdm(total=total, desc="generate", unit="tok", disable=not progress) as bar:
            remaining = len(wanted)
            while remaining:
                before = sum(len(s.output_ids) for s in seqs)
                for out in self.step():
                    if out.request_id in wanted:
                        wanted[out.request_id] = out
                        remaining -= 1
                bar.update(sum(len(s.output_ids) for s in seqs) - before)
        return list(wanted.values())

    def spec_stats(self) -> dict[str, float]:
        """What speculative decoding did so far: drafted, accepted and rejected tokens,
        acceptance rate, output tokens per target forward, blocks rolled back."""
        if self.speculator is None:
            raise ValueError("spec_stats() needs EngineConfig(speculative=...)")
        return self.speculator.stats.as_dict()

    def stats(self) -> pd.DataFrame:
        """Per-step telemetry as a DataFrame (one row per step)."""
        return self.telemetry.frame()

    def request_stats(self) -> pd.DataFrame:
        """One row per finished request: arrival, first token, finish, ttft, tpot, tokens."""
        rows = [
            {
                "request_id": out.request_id,
                "prompt_tokens": len(out.prompt_token_ids),
                "output_tokens": len(out.token_ids),
                "arrival_s": out.metrics.arrival_s,
                "first_token_s": out.metrics.first_token_s,
                "finish_s": out.metrics.finish_s,
                "ttft_s": out.metrics.ttft_s,
                "tpot_s": out.metrics.tpot_s,
                "preemptions": out.metrics.preemptions,
                "stall_s": out.metrics.stall_s,
                "prefix_hit_tokens": out.metrics.prefix_hit_tokens,
                "finish_reason": out.finish_reason,
            }
            for out in self.finished
        ]
        return pd.DataFrame(rows)


def _eos_ids(model: LoadedModel) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model.hf_model, "generation_config", None), model.tokenizer):
        value = getattr(source, "eos_token_id", None)
        if value is not None:
            ids.update([value] if isinstance(value, int) else value)
    return ids
