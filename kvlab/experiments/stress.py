"""Notebook 05's experiments: the scheduler under memory pressure, measured live.

- `gantt_intervals`, `step_of`: a request's life (waiting / running / preempted /
  swapped) as intervals, from `engine.scheduler.events`, in seconds or engine steps.
- `burst`, `kv_demand`, `oversubscribed_budget`, `serve_burst`, `burst_summary`: a burst
  of requests served with a fraction of the KV memory it needs.
- `preemption_cost`: what one preemption costs, swap against recompute, by victim length.
- `percentiles`, `serve_batching`: static against continuous batching.
- `long_prompt_arrives`, `decode_gaps`, `gap_percentiles`: running decodes while a long
  prompt comes in, with and without chunked prefill.

Everything counted in tokens, blocks or bytes is deterministic for greedy `ignore_eos`
runs; anything in seconds is a measurement of this machine.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import numpy as np
import pandas as pd

from kvlab import texts
from kvlab.build import Engine
from kvlab.config import EngineConfig, SamplingParams
from kvlab.engine.outputs import RequestOutput
from kvlab.engine.requests import Prompt
from kvlab.engine.scheduler import Event
from kvlab.model.loading import LoadedModel
from kvlab.workloads import Request

STATES = ("waiting", "running", "preempted", "swapped")  # the states a Gantt bar can show
TERMINAL = ("finished", "cancelled")
PRESSURED = dict(cache="paged", admission="watermark")  # config that preempts instead of waiting


# --- Gantt intervals -----------------------------------------------------------------------
def gantt_intervals(events: Iterable[Event], end_s: float) -> pd.DataFrame:
    """Each request's states as intervals: request_id, state, start, end.

    An event opens the interval of its state and closes the request's previous one; a
    "finished" or "cancelled" event closes the last. A request still open at the end of the
    log runs until `end_s`. Zero-length intervals (a state entered and left at once) are
    dropped, and what they separated is joined when the state is the same on both sides.
    Times are whatever the events carry (seconds, or steps after `step_of`).
    """
    rows: list[tuple[int, str, float, float]] = []
    open_: dict[int, tuple[str, float]] = {}
    for event in sorted(events, key=lambda e: e.time_s):  # stable: same-time order is kept
        if event.request_id in open_:
            state, start = open_.pop(event.request_id)
            rows.append((event.request_id, state, start, event.time_s))
        if event.state not in TERMINAL:
            open_[event.request_id] = (str(event.state), event.time_s)
    rows += [(rid, state, start, max(start, end_s)) for rid, (state, start) in open_.items()]
    merged: list[list] = []
    for rid, state, start, end in sorted(
        (row for row in rows if row[3] > row[2]), key=lambda row: (row[0], row[2])
    ):
        last = merged[-1] if merged else None
        if last and last[0] == rid and last[1] == state and last[3] == start:
            last[3] = end
        else:
            merged.append([rid, state, start, end])
    return pd.DataFrame(merged, columns=["request_id", "state", "start", "end"])


def step_of(times_s: Sequence[float] | np.ndarray, stats: pd.DataFrame) -> np.ndarray:
    """Engine-clock times as step boundaries: the number of steps begun before each time.

    Step k (1-based) spans [k - 1, k]. Scheduling (admission, preemption, swap-in) happens
    before a step's forward begins, so it lands on that step's start; a request that
    finishes during step k's forward lands on its end, k. Deterministic for a given
    schedule, however long each step took.
    """
    begun = np.sort((stats["time_s"] - stats["step_s"]).to_numpy())
    return np.searchsorted(begun, np.asarray(times_s, dtype=float), side="left")


def engine_events(engine: Engine) -> list[Event]:
    """The engine's scheduler events, each finish stamped with its request's finish time.

    (The scheduler stamps a "finished" event with the time its step was scheduled; the
    request's output carries when its last token actually came out.)
    """
    finish = {o.request_id: o.metrics.finish_s for o in engine.finished}
    return [
        Event(finish[e.request_id], e.request_id, e.state)
        if e.state in TERMINAL and e.request_id in finish
        else e
        for e in engine.scheduler.events
    ]


def step_events(engine: Engine) -> list[Event]:
    """`engine_events` with times replaced by step boundaries (`step_of`)."""
    events = engine_events(engine)
    steps = step_of([e.time_s for e in events], engine.stats())
    return [Event(int(s), e.request_id, e.state) for e, s in zip(events, steps)]


# --- a burst under pressure ----------------------------------------------------------------
def burst(n: int, max_new_tokens: int = 32) -> list[Request]:
    """n chat prompts (kvlab.texts, ~40 tokens with the chat template), all arriving at once,
    each asking for `max_new_tokens` (serve with ignore_eos=True for exact counts)."""
    pool = texts.chat_prompts()
    return [Request(pool[i % len(pool)], max_new_tokens) for i in range(n)]


def kv_demand(engine: Engine, requests: Sequence[Request]) -> int:
    """Token slots the requests need at their longest: prompt + max_new_tokens, summed."""
    return sum(len(engine.encode(r.prompt)) + r.max_new_tokens for r in requests)


def oversubscribed_budget(demand_tokens: int, factor: float, block_size: int) -> int:
    """A KV budget in token slots, whole blocks, of about demand / factor."""
    return max(block_size, block_size * int(demand_tokens / factor / block_size))


def serve_burst(
    model: LoadedModel,
    requests: Sequence[Request],
    budget_tokens: int | None = None,
    preemption: str = "recompute",
    **config,
) -> tuple[Engine, list[RequestOutput]]:
    """Serve `requests` (ignore_eos) on a paged engine with watermark admission.

    With `budget_tokens=None` the budget is roomy (no pressure): the reference run.
    Extra keyword arguments go to EngineConfig (block_size, max_model_len, ...).
    """
    settings = dict(PRESSURED, preemption=preemption, max_model_len=512)
    settings.update(config)
    if budget_tokens is None:
        settings.update(admission="reserve", kv_budget_tokens=None)
    else:
        settings["kv_budget_tokens"] = budget_tokens
    engine = Engine(model, EngineConfig(**settings))
    return engine, engine.run(list(requests), ignore_eos=True)


def burst_summary(engine: Engine, outputs: Sequence[RequestOutput]) -> dict[str, int]:
    """Deterministic counts of a served burst: completed (all tokens, finish "length"),
    errors (anything else), preemptions, bytes swapped out, tokens recomputed, peak
    running and blocks still held at the end."""
    stats = engine.stats()
    completed = sum(o.finish_reason == "length" for o in outputs)
    return {
        "requests": len(outputs),
        "completed": completed,
        "errors": len(outputs) - completed,
        "preemptions": engine.scheduler.preemptions,
        "swapped_bytes": engine.scheduler.swapped_bytes,
        "recomputed_tokens": engine.scheduler.recomputed_tokens,
        "steps": len(stats),
        "peak_running": int(stats["running"].max()),
        "blocks": engine.cache.num_blocks,
        "blocks_held_at_end": engine.cache.num_blocks - engine.cache.num_available,
    }


# --- what one preemption costs -------------------------------------------------------------
def preemption_cost(
    model: LoadedModel,
    prompt_ids: Sequence[int],
    lengths: Sequence[int],
    mode: str,
    baseline_steps: int = 3,
    repeats: int = 3,
) -> pd.DataFrame:
    """Preempt one victim of each length and resume it, `repeats` times; one row per length.

    For every length L a fresh engine prefills the first L tokens of `prompt_ids` and
    decodes `baseline_steps` tokens (plain decode steps, the baseline); then `repeats`
    times the scheduler preempts the sequence (`mode`: "swap" or "recompute"), the next
    step resumes it, and one plain decode step follows. Each round adds two tokens to
    the victim; the seconds are medians over the rounds.

    Columns: victim_tokens (its length at the first preemption), bytes_swapped (copied to
    host memory by that preemption; as many come back on resume), tokens_recomputed
    (prefilled again by it), and in seconds: preempt_s (taking the blocks away: the copy
    out, for swap), copy_in_s (swap: the copy back into fresh blocks, timed on its own;
    0 for recompute), resume_step_s (the step that brings the victim back and decodes its
    next token: copy in + decode, or prefill it all again), decode_step_s (median plain
    decode step), decode_spread_s (max - min of the plain decode steps: how much a step
    varies by itself on this machine) and extra_s, what the preemption added: for swap
    preempt_s + copy_in_s, the two copies timed directly (a copy of a few milliseconds
    would drown in decode_spread_s if taken as a difference of step times, and could come
    out negative); for recompute preempt_s + resume_step_s - decode_step_s, the prefill.
    """
    rows = []
    for length in lengths:
        grown = length + baseline_steps + 2 * repeats
        config = EngineConfig(
            **PRESSURED,
            preemption=mode,
            max_model_len=grown + 8,
            kv_budget_tokens=grown + 16,
        )
        engine = Engine(model, config)
        params = SamplingParams(baseline_steps + 2 * repeats + 2, ignore_eos=True)
        engine.add_request(list(prompt_ids[:length]), params)
        for _ in range(1 + baseline_steps):  # prefill (first token), then plain decodes
            engine.step()
        [victim] = engine.scheduler.running
        victim_tokens = victim.num_computed
        scheduler = engine.scheduler
        preempts, resumes, copies_in, moved = [], [], [], None
        for _ in range(repeats):
            started = time.perf_counter()
            scheduler.preempt(victim)
            preempts.append(time.perf_counter() - started)
            moved = moved or (scheduler.swapped_bytes, scheduler.recomputed_tokens)
            copied = scheduler.swap_in_s
            engine.step()  # swap in + decode, or prefill everything again
            if scheduler.swap_in_s > copied:  # the copy back, timed by the scheduler
                copies_in.append(scheduler.swap_in_s - copied)
            resumes.append(float(engine.stats()["step_s"].iloc[-1]))
            engine.step()  # a plain decode before the next round
        step_s = engine.stats()["step_s"].to_numpy()
        plain = [*range(1, 1 + baseline_steps)]
        plain += [1 + baseline_steps + 2 * k + 1 for k in range(repeats)]
        decodes = step_s[plain]
        preempt_s = float(np.median(preempts))
        copy_in_s = float(np.median(copies_in)) if copies_in else 0.0
        resume_s, decode_s = float(np.median(resumes)), float(np.median(decodes))
        extra = preempt_s + (copy_in_s if mode == "swap" else resume_s - decode_s)
        rows.append(
            {
                "mode": mode,
                "victim_tokens": victim_tokens,
                "bytes_swapped": moved[0],
                "tokens_recomputed": moved[1],
                "preempt_s": preempt_s,
                "copy_in_s": copy_in_s,
                "resume_step_s": resume_s,
                "decode_step_s": decode_s,
                "decode_spread_s": float(decodes.max() - decodes.min()),
                "extra_s": extra,
            }
        )
    return pd.DataFrame(rows)


# --- static vs continuous batching ---------------------------------------------------------
def percentiles(
    request_stats: pd.DataFrame,
    columns: Sequence[str] = ("ttft_s", "tpot_s", "latency_s"),
    q: Sequence[int] = (50, 95),
) -> pd.Series:
    """p50/p95 (or `q`) of per-request metrics; `latency_s` is finish - arrival."""
    frame = request_stats.assign(latency_s=request_stats["finish_s"] - request_stats["arrival_s"])
    return pd.Series(
        {f"{col} p{p}": float(np.percentile(frame[col], p)) for col in columns for p in q}
    )


def alternating(requests: Sequence[Request], lengths: Sequence[int]) -> list[Request]:
    """Copies of `requests` whose max_new_tokens cycle through `lengths` (4, 48, 4, ...)."""
    return [
        Request(r.prompt, lengths[i % len(lengths)], r.arrival_s, r.salt, r.priority)
        for i, r in enumerate(requests)
    ]


def serve_batching(
    model: LoadedModel, requests: Sequence[Request], batching: str, max_num_seqs: int = 4
) -> tuple[Engine, dict[str, float]]:
    """Serve `requests` (ignore_eos) with `batching` ("static" | "continuous") and at most
    `max_num_seqs` running; returns the engine and its steps, tokens, wall time and
    throughput (output tokens per second of engine time from first arrival to last token)."""
    config = EngineConfig(
        cache="paged", batching=batching, max_num_seqs=max_num_seqs, max_model_len=512,
        kv_budget_tokens=max_num_seqs * 512,
    )  # fmt: skip
    engine = Engine(model, config)
    outputs = engine.run(list(requests), ignore_eos=True)
    tokens = sum(len(o.token_ids) for o in outputs)
    wall = max(o.metrics.finish_s for o in outputs) - min(o.metrics.arrival_s for o in outputs)
    return engine, {
        "steps": len(engine.stats()),
        "output_tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
    }


# --- a long prompt arrives while others decode ---------------------------------------------
def long_prompt_arrives(
    model: LoadedModel,
    config: EngineConfig,
    stream_prompts: Sequence[Prompt],
    long_prompt: Prompt,
    stream_tokens: int = 32,
    warmup_tokens: int = 4,
    long_tokens: int = 4,
) -> Engine:
    """`stream_prompts` start decoding (`stream_tokens` each); once every stream has
    `warmup_tokens` tokens, a long prompt arrives; the engine then runs until everything
    has finished. The streams are requests 0..n-1, the long prompt request n.
    """
    engine = Engine(model, config)
    for prompt in stream_prompts:
        engine.add_request(prompt, SamplingParams(stream_tokens, ignore_eos=True))
    scheduler = engine.scheduler
    while scheduler.waiting or any(len(s.output_ids) < warmup_tokens for s in scheduler.running):
        engine.step()
    engine.add_request(long_prompt, SamplingParams(long_tokens, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    return engine


def decode_gaps(stats: pd.DataFrame) -> pd.DataFrame:
    """Time between consecutive tokens of the running decode streams, per token.

    Decode streams emit a token in every step that contains decodes (phase "decode" or
    "mixed"); a prefill-only step in between (a whole long prompt, without chunking)
    stalls them. One row per decode-containing step: step, phase, tokens, step_s, and
    gap_s = its end minus the end of the previous decode-containing step (for the first,
    the end of the step just before it: the streams' last prefill).
    """
    first = stats.index[stats["phase"] != "prefill"].min() - 1  # the streams' last prefill
    emits = stats[(stats["phase"] != "prefill") | (stats.index == first)]
    gaps = emits.assign(gap_s=emits["time_s"].diff()).iloc[1:]
    return gaps[["step", "phase", "tokens", "step_s", "gap_s"]].reset_index(drop=True)


def gap_percentiles(gaps: pd.DataFrame) -> dict[str, float]:
    """The decode streams' time per output token from `decode_gaps`: its median, p95 and
    maximum gap_s, in seconds ("tpot_p50_s", "tpot_p95_s", "tpot_max_s"). A stall (a whole
    long prefill between two decode steps) shows in the maximum."""
    seconds = gaps["gap_s"].to_numpy()
    return {
        "tpot_p50_s": round(float(np.percentile(seconds, 50)), 4),
        "tpot_p95_s": round(float(np.percentile(seconds, 95)), 4),
        "tpot_max_s": round(float(seconds.max()), 4),
    }
