"""The speculative-decoding benchmark (kvlab.experiments.speculative) and its figures on
the tiny model: counts, token identity and acceptance (never timings).

The random tiny model seldom repeats itself, so drafts are mostly rejected (1-grams,
prompt_lookup_min=1, give it the most drafts); `[42] * 20` gets it to loop, and some
drafts are accepted. The real model's figures come from benchmarks/speculative.py.
"""

from __future__ import annotations

import pytest

import kvlab
from kvlab import EngineConfig, SamplingParams
from kvlab.experiments import speculative
from kvlab.viz.speculative import (
    STATES,
    batch_figure,
    describe_event,
    k_figure,
    rollback_animation,
    slot_states,
)
from kvlab.workloads import Request

PROMPTS = [[42] * 20, [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7], [11, 12, 13]]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def result(tiny_model):
    workloads = {"loops": [Request(p, NEW_TOKENS) for p in PROMPTS]}
    return speculative.compare_speculation(
        tiny_model, workloads, ks=(2,), layers_k=1, sweep_workload="loops",
        sweep_batch_sizes=(1, 3), sweep_k=2, ngram_min=1,
    )  # fmt: skip


def test_every_run_keeps_the_greedy_tokens(result):
    assert result.mismatches() == []
    frame = result.frame()
    assert frame.identical.all()
    assert len(frame) == 3 + 2 + 4  # kvlab none/k2/layers, hf none/k2, the sweep
    assert result.meta["kvlab_vs_hf_identical"] == {"loops": "3/3 prompts"}


def test_counts_add_up(result):
    for run in result.runs:
        assert run.accepted <= run.drafted
        assert run.decode_tokens == run.output_tokens - len(run.outputs)
        if run.method == "none":
            assert run.drafted == 0 and run.tokens_per_forward == 1.0
        else:
            assert run.drafted > 0
        if run.decode_forwards:
            # each forward emits its accepted drafts + one (the last may be cut short)
            assert run.decode_tokens <= run.decode_forwards + run.accepted
    frame = result.frame()
    assert (frame[frame.method == "none"].decode_speedup == 1.0).all()


def test_drafts_are_drafted_and_some_accepted(result):
    """n-gram drafts on every system; on the loop, some are right: a forward then
    yields more than one token, and tokens per forward counts it."""
    by_name = {(r.system, r.name): r for r in result.runs if r.part == "k"}
    for name in [("kvlab", "ngram k=2"), ("hf", "prompt-lookup k=2")]:
        run = by_name[name]
        assert run.drafted > 0 and run.accepted > 0, run
        assert run.tokens_per_forward > 1.0
    # cut at max_new_tokens at most once per request
    kvlab_ngram = by_name[("kvlab", "ngram k=2")]
    slack = kvlab_ngram.decode_forwards + kvlab_ngram.accepted - kvlab_ngram.decode_tokens
    assert 0 <= slack <= 2 * len(PROMPTS)


def test_batch_sweep(result):
    sweep = [r for r in result.runs if r.part == "batch"]
    assert [(r.batch_size, r.method) for r in sweep] == [
        (1, "none"), (1, "ngram"), (3, "none"), (3, "ngram")
    ]  # fmt: skip
    assert sweep[2].output_tokens == sweep[0].output_tokens + sum(
        len(o) for o in sweep[2].outputs[1:]
    )  # batch 3: the three prompts; batch 1: the first
    assert all(r.identical for r in sweep)


def test_figures(result):
    frame = result.frame()
    # kvlab ngram, kvlab layers, hf prompt lookup, in 3 panels
    assert len(k_figure(frame).data) == 3 * 3
    assert len(batch_figure(frame).data) == 3


def test_set_speculation_waits_for_an_idle_engine(tiny_model):
    engine = speculative.prefix_engine(tiny_model, [Request(PROMPTS[0], 4)])
    engine.add_request(PROMPTS[0], SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match="unfinished"):
        speculative.set_speculation(engine, None)


def test_rollback_animation_frames(tiny_model):
    config = EngineConfig(cache="paged", block_size=2, record_block_map=True,
                          speculative={"method": "ngram", "num_speculative_tokens": 4})  # fmt: skip
    engine = kvlab.Engine(tiny_model, config)
    engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=24, ignore_eos=True))
    events = engine.speculator.events
    assert any(e.accepted for e in events) and any(e.accepted < len(e.drafts) for e in events)
    fig = rollback_animation(events, block_size=2, rows=4)
    assert len(fig.frames) == 2 * len(events)
    for e in events:
        during = sum(slot_states(e, 2, 4, after=False), [])
        after = sum(slot_states(e, 2, 4, after=True), [])
        assert during.count(STATES.index("pending")) == 1
        assert during.count(STATES.index("accepted draft")) == e.accepted
        assert during.count(STATES.index("rejected draft")) == len(e.drafts) - e.accepted
        assert STATES.index("rejected draft") not in after
        returned = after.count(STATES.index("returned"))
        assert returned == 2 * (len(e.table) - len(e.kept))
        assert f"{len(e.drafts)} drafts, {e.accepted} accepted" in describe_event(e)


@pytest.mark.parametrize("variant", [{"repeats": 2}, {"cold": False}], ids=["repeats", "warm"])
def test_repeated_and_warm_runs_keep_the_counts_of_one_cold_round(tiny_model, result, variant):
    """repeats=2: every configuration runs twice in interleaved rounds; the counts are the
    first round's (drafts are not counted twice), the times each one's fastest. cold=False
    (notebook 09): every run decodes from its prompt's cached K/V instead of prefilling it
    from an empty prefix cache. Either way tokens, forwards and drafts are the same."""
    workloads = {"loops": [Request(p, NEW_TOKENS) for p in PROMPTS]}
    other = speculative.compare_speculation(
        tiny_model, workloads, ks=(2,), layers_k=1, hf=False, sweep_workload="loops",
        sweep_batch_sizes=(1, 3), sweep_k=2, ngram_min=1, **variant,
    )  # fmt: skip
    once = [r for r in result.runs if r.system == "kvlab"]
    assert len(other.runs) == len(once) and other.mismatches() == []
    for a, b in zip(once, other.runs):
        assert (a.name, a.batch_size, a.part) == (b.name, b.batch_size, b.part)
        assert (a.output_tokens, a.decode_forwards, a.drafted, a.accepted) == (
            b.output_tokens, b.decode_forwards, b.drafted, b.accepted
        )  # fmt: skip
        assert a.outputs == b.outputs and b.identical
        assert 0 < b.decode_s <= b.wall_s
