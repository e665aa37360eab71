"""Notebook 05's helpers, figures and widget, driven from pytest on tiny live bursts."""

from __future__ import annotations

import pandas as pd
import pytest

import kvlab
from kvlab.engine.scheduler import Event
from kvlab.experiments import stress
from kvlab.viz.scheduler import (
    StressExplorer,
    cost_figure,
    free_blocks_figure,
    gantt_figure,
    gaps_figure,
    pressure_figure,
)


def test_gantt_intervals_follow_the_events():
    events = [
        Event(0.0, 0, "waiting"),
        Event(0.0, 1, "waiting"),
        Event(1.0, 0, "running"),
        Event(1.0, 1, "running"),
        Event(1.0, 1, "swapped"),  # admitted and swapped out at once: no running bar
        Event(3.0, 0, "finished"),
        Event(4.0, 1, "running"),
        Event(2.0, 2, "waiting"),  # out of order in the log: sorted by time
        Event(5.0, 2, "cancelled"),
        Event(0.0, 3, "waiting"),
        Event(1.0, 3, "running"),
        Event(2.0, 3, "preempted"),
        Event(4.0, 3, "running"),  # re-admitted and preempted again at once: one bar
        Event(4.0, 3, "preempted"),
        Event(5.0, 3, "running"),
        Event(6.0, 3, "finished"),
    ]
    bars = stress.gantt_intervals(events, end_s=6.0)
    assert bars.values.tolist() == [
        [0, "waiting", 0.0, 1.0],
        [0, "running", 1.0, 3.0],
        [1, "waiting", 0.0, 1.0],
        [1, "swapped", 1.0, 4.0],
        [1, "running", 4.0, 6.0],  # still running when the log ends
        [2, "waiting", 2.0, 5.0],
        [3, "waiting", 0.0, 1.0],
        [3, "running", 1.0, 2.0],
        [3, "preempted", 2.0, 5.0],
        [3, "running", 5.0, 6.0],
    ]


def test_step_of_puts_scheduling_on_step_starts_and_finishes_on_step_ends():
    stats = pd.DataFrame({"time_s": [1.0, 2.0, 4.0], "step_s": [0.5, 0.5, 1.0]})  # begun 0.5/1.5/3
    assert stress.step_of([0.0, 0.6, 1.2, 1.6, 3.5, 9.0], stats).tolist() == [0, 1, 1, 2, 3, 3]


@pytest.fixture(scope="module")
def requests():
    return stress.burst(5, max_new_tokens=12)


@pytest.fixture(scope="module")
def runs(tiny_model, requests):
    """The burst without pressure, then with a third of the memory, in both modes."""
    calm, calm_outputs = stress.serve_burst(tiny_model, requests)
    demand = stress.kv_demand(calm, requests)
    budget = stress.oversubscribed_budget(demand, 3, block_size=8)
    out = {"calm": (calm, calm_outputs)}
    for mode in ("recompute", "swap"):
        out[mode] = stress.serve_burst(tiny_model, requests, budget, mode, block_size=8)
    return out


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_burst_under_pressure_completes_like_the_calm_run(runs, mode):
    calm_outputs = runs["calm"][1]
    engine, outputs = runs[mode]
    assert [o.token_ids for o in outputs] == [o.token_ids for o in calm_outputs]
    summary = stress.burst_summary(engine, outputs)
    assert summary["completed"] == 5 and summary["errors"] == 0
    assert summary["preemptions"] > 0 and summary["blocks_held_at_end"] == 0
    moved = "swapped_bytes" if mode == "swap" else "recomputed_tokens"
    other = "recomputed_tokens" if mode == "swap" else "swapped_bytes"
    assert summary[moved] > 0 and summary[other] == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_pressure_figure_draws_every_request_from_arrival_to_finish(runs, mode):
    engine, _ = runs[mode]
    stats = engine.stats()
    fig = pressure_figure(engine, x="step")
    bars = {trace.name: trace for trace in fig.data[:4]}
    assert list(bars) == ["waiting", "running", "preempted", "swapped"]
    mark = "swapped" if mode == "swap" else "preempted"
    assert len(bars[mark].y) > 0
    assert len(bars["swapped" if mode == "recompute" else "preempted"].y) == 0
    spans: dict[str, list[tuple[float, float]]] = {}
    for trace in bars.values():
        for label, base, length in zip(trace.y, trace.base, trace.x):
            assert length > 0
            spans.setdefault(label, []).append((base, base + length))
    assert sorted(spans) == [f"req {r}" for r in range(5)]
    for label, pieces in spans.items():
        pieces.sort()
        assert pieces[0][0] == 0  # all arrived before the first step
        assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:])), label  # no gaps
        assert pieces[-1][1] <= len(stats)
    assert max(end for pieces in spans.values() for _, end in pieces) == len(stats)
    free, marks = fig.data[4], fig.data[5]
    assert free.y[0] == free.y[-1] == engine.cache.num_blocks
    assert list(free.y[1:]) == stats["blocks_free"].tolist()
    assert 0 < len(marks.x) <= engine.scheduler.preemptions
    victims = sum(len(text.split(", ")) for text in marks.text)
    assert victims == engine.scheduler.preemptions
    free_at = dict(zip(free.x, free.y))
    assert all(free_at[x] == y for x, y in zip(marks.x, marks.y))  # on the free-blocks line
    assert f"{engine.scheduler.preemptions} preemptions ({mode})" in fig.layout.title.text
    timed = pressure_figure(engine, x="time")  # same bars, in seconds from the first arrival
    assert sum(len(t.y) for t in timed.data[:4]) >= 5 and min(timed.data[0].base) >= 0


def test_single_figures(runs):
    engines = {mode: runs[mode][0] for mode in ("recompute", "swap")}
    assert [t.name for t in gantt_figure(engines["swap"]).data] == list(stress.STATES)
    fig = free_blocks_figure(engines)
    assert [t.name for t in fig.data] == ["recompute", "swap"]
    with pytest.raises(ValueError, match="x='steps'"):
        gantt_figure(engines["swap"], x="steps")


def test_explorer_reruns_the_burst_on_every_control(tiny_model):
    explorer = StressExplorer(tiny_model, budget_tokens=96, burst=3, max_new_tokens=8, max_burst=5)
    fig = explorer.figure
    rows = lambda: {y for trace in fig.data[:4] for y in trace.y}  # noqa: E731
    assert rows() == {"req 0", "req 1", "req 2"}
    assert explorer.budget.value == 96 and explorer.budget.min <= 96 <= explorer.budget.max
    explorer.burst.value = 5
    assert rows() == {f"req {r}" for r in range(5)}
    assert explorer.results["requests"] == explorer.results["completed"] == 5
    explorer.budget.value = explorer.budget.min  # tightest: the watermark admits one at a time
    assert explorer.results["peak_running"] == 1 and explorer.results["preemptions"] == 0
    explorer.budget.value = 88  # 11 blocks: two are admitted and outgrow the budget
    assert explorer.results["preemptions"] > 0
    assert len(fig.data[2].y) > 0 and len(fig.data[3].y) == 0  # preempted bars, no swapped
    free_before = list(fig.data[4].y)
    explorer.policy.value = "swap"
    assert len(fig.data[3].y) > 0 and len(fig.data[2].y) == 0
    assert explorer.results["swapped_bytes"] > 0 and "(swap)" in fig.layout.title.text
    assert fig.data[4].y[0] == explorer.engine.cache.num_blocks
    explorer.budget.value = explorer.budget.max  # room for everyone: no preemption at all
    assert explorer.results["preemptions"] == 0 and list(fig.data[4].y) != free_before
    assert len(fig.data[5].x) == 0


def test_preemption_cost_counts_what_moves(tiny_model):
    ids = list(range(1, 200))
    costs = pd.concat(
        [stress.preemption_cost(tiny_model, ids, [16, 64], mode) for mode in ("swap", "recompute")]
    )
    per_token = kvlab.Engine(
        tiny_model, kvlab.EngineConfig(cache="paged")
    ).cache.pool.bytes_per_token
    swap, recompute = costs[costs["mode"] == "swap"], costs[costs["mode"] == "recompute"]
    assert swap["victim_tokens"].tolist() == recompute["victim_tokens"].tolist() == [19, 67]
    assert swap["bytes_swapped"].tolist() == [19 * per_token, 67 * per_token]
    assert recompute["tokens_recomputed"].tolist() == [19, 67]
    assert (swap["tokens_recomputed"] == 0).all() and (recompute["bytes_swapped"] == 0).all()
    assert (costs[["preempt_s", "resume_step_s", "decode_step_s"]] > 0).all().all()
    # swap's extra is the two copies, timed directly: never a negative difference of steps
    assert (swap["copy_in_s"] > 0).all() and (recompute["copy_in_s"] == 0).all()
    assert swap["extra_s"].tolist() == (swap["preempt_s"] + swap["copy_in_s"]).tolist()
    assert (costs["decode_spread_s"] >= 0).all()
    fig = cost_figure(costs)
    names = [t.name for t in fig.data]
    assert names[:2] == [f"{mode}: extra time" for mode in ("swap", "recompute")]
    assert "a plain decode step" in names and fig.layout.yaxis.type == "log"
    assert list(fig.data[-1].y) == [19, 67]


def test_chunked_prefill_keeps_decodes_flowing(tiny_model):
    streams = [[1 + (i * 31 + j) % 500 for j in range(12)] for i in range(3)]
    long_prompt = list(range(1, 201))
    base = dict(cache="paged", max_model_len=512, kv_budget_tokens=1024)
    configs = {
        "whole": kvlab.EngineConfig(**base),
        "chunked": kvlab.EngineConfig(
            **base, chunked_prefill=True, schedule_order="decode-first", max_num_batched_tokens=32
        ),
    }
    gaps, stats = {}, {}
    for name, config in configs.items():
        engine = stress.long_prompt_arrives(
            tiny_model, config, streams, long_prompt, stream_tokens=16, warmup_tokens=3
        )
        assert len(engine.finished) == 4
        stats[name] = engine.stats()
        gaps[name] = stress.decode_gaps(stats[name])
        assert (gaps[name]["gap_s"] > 0).all()
        assert len(gaps[name]) == (stats[name]["phase"] != "prefill").sum()
    # Without chunking the whole long prompt is one prefill-only step (step 4) between two
    # decode steps: the streams' gap across it is at least that step.
    phases = "".join(p[0] for p in stats["whole"]["phase"])  # p(refill), d(ecode)
    assert phases == "pdd" + "p" + "d" * 13
    assert gaps["whole"]["step"].iloc[2] == 5
    assert gaps["whole"]["gap_s"].iloc[2] >= stats["whole"]["step_s"].iloc[3]
    # With chunking and decode-first the prompt goes in 32-token chunks beside the decodes
    # (mixed steps): after the streams' own prompts, no step leaves them out.
    chunked = stats["chunked"]
    started = chunked.index[chunked["phase"] != "prefill"].min()
    assert (chunked["phase"].iloc[started:] != "prefill").all()
    assert (chunked["phase"] == "mixed").sum() >= 200 // 32
    assert (chunked["tokens"] <= 32).all()
    fig = gaps_figure(gaps)
    assert [t.name for t in fig.data] == ["whole", "chunked"]


def test_gap_percentiles_show_the_stall():
    gaps = pd.DataFrame({"gap_s": [0.1] * 19 + [5.0]})  # one stalled step in twenty
    summary = stress.gap_percentiles(gaps)
    assert summary == {"tpot_p50_s": 0.1, "tpot_p95_s": 0.345, "tpot_max_s": 5.0}


def test_static_batching_takes_more_steps_than_continuous(tiny_model):
    requests = stress.alternating(stress.burst(6), [2, 12])
    assert [r.max_new_tokens for r in requests] == [2, 12] * 3
    results = {b: stress.serve_batching(tiny_model, requests, b, max_num_seqs=2) for b in
               ("static", "continuous")}  # fmt: skip
    static, continuous = results["static"][1], results["continuous"][1]
    assert static["output_tokens"] == continuous["output_tokens"] == 42
    assert static["steps"] > continuous["steps"]
    table = stress.percentiles(results["static"][0].request_stats())
    assert list(table.index) == [
        f"{m} p{q}" for m in ("ttft_s", "tpot_s", "latency_s") for q in (50, 95)
    ]
