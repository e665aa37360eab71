"""Notebook 01's measurements: decoding with and without a cache, on the tiny model."""

from __future__ import annotations

import pytest

from kvlab import texts
from kvlab.experiments.why_cache import compare_decoding, latency_by_context
from kvlab.model.runner import ModelRunner


@pytest.fixture(scope="module")
def runner(tiny_model) -> ModelRunner:
    return ModelRunner(tiny_model.hf_model)


@pytest.fixture(scope="module")
def text_ids(tiny_model) -> list[int]:
    return tiny_model.tokenizer.encode(texts.heldout())[:96]


def test_both_modes_decode_the_same_tokens(runner, text_ids):
    frame = compare_decoding(runner, text_ids[:16], new_tokens=6)
    by_mode = {mode: rows["token"].tolist() for mode, rows in frame.groupby("mode")}
    assert by_mode["no cache"] == by_mode["KV cache"]
    assert frame["position"].tolist() == list(range(16, 22)) * 2


def test_latency_by_context_times_each_length_both_ways(runner, text_ids):
    frame = latency_by_context(runner, text_ids, [8, 32, 96], repeats=2)
    assert frame["context"].tolist() == [8, 8, 32, 32, 96, 96]
    assert frame["mode"].tolist() == ["no cache", "KV cache"] * 3
    assert (frame["latency_s"] > 0).all()
    # The cached forward over token n alone predicts what a forward over all n predicts.
    assert frame.groupby("context")["token"].nunique().eq(1).all()


def test_latency_by_context_needs_enough_text(runner, text_ids):
    with pytest.raises(ValueError, match="lengths go up to 200 tokens; text_ids has 96"):
        latency_by_context(runner, text_ids, [8, 200])
