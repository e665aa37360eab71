"""The speculative-decoding benchmark (kvlab.experiments.speculative) and its figures:
counts, token identity and acceptance (never timings). The real model on a short doc-QA
prompt (its answer quotes the document, so drafts get accepted) and a chat prompt; the
tiny model where only the mechanics matter."""

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

LOOPS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7], list(range(100, 140)) + list(range(100, 110))]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def workloads(model):
    """One doc-QA prompt of at most 520 tokens (a short document) and one chat prompt."""
    return speculative.spec_workloads(model, 1, 1, NEW_TOKENS, max_prompt_tokens=520)


@pytest.fixture(scope="module")
def result(model, workloads):
    return speculative.compare_speculation(
        model, workloads, ks=(2,), layers_k=2, sweep_batch_sizes=(1, 3), sweep_k=2
    )


def test_every_run_keeps_the_greedy_tokens(result):
    assert result.mismatches() == []
    frame = result.frame()
    assert frame.identical.all()
    assert len(frame) == 2 * (3 + 2) + 4  # per workload: kvlab none/k2/layers, hf none/k2
    assert result.meta["kvlab_vs_hf_identical"] == {"doc-qa": "1/1 prompts", "chat": "1/1 prompts"}


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


def test_ngram_drafts_are_accepted_on_doc_qa_for_kvlab_and_hf(result):
    for run in result.runs:
        if run.workload == "doc-qa" and run.method in ("ngram", "prompt-lookup"):
            assert run.accepted > 0 and run.tokens_per_forward > 1.0, run


def test_batch_sweep(result):
    sweep = [r for r in result.runs if r.part == "batch"]
    assert [(r.batch_size, r.method) for r in sweep] == [
        (1, "none"), (1, "ngram"), (3, "none"), (3, "ngram")
    ]  # fmt: skip
    one, three = sweep[0].output_tokens, sweep[2].output_tokens
    assert three == 3 * one  # the one doc-QA prompt, three times
    assert all(r.identical for r in sweep)


def test_figures(result):
    frame = result.frame()
    # (kvlab ngram, kvlab layers, hf prompt lookup) x 2 workloads, in 3 panels
    assert len(k_figure(frame).data) == 3 * 2 * 3
    assert len(batch_figure(frame).data) == 3


def test_set_speculation_waits_for_an_idle_engine(tiny_model):
    engine = speculative.prefix_engine(tiny_model, [Request(LOOPS[0], 4)])
    engine.add_request(LOOPS[0], SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match="unfinished"):
        speculative.set_speculation(engine, None)


def test_rollback_animation_frames(model, workloads):
    config = EngineConfig(cache="paged", block_size=2, record_block_map=True,
                          speculative={"method": "ngram", "num_speculative_tokens": 4})  # fmt: skip
    engine = kvlab.Engine(model, config)
    engine.generate([list(workloads["doc-qa"][0].prompt)], SamplingParams(max_new_tokens=12))
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
