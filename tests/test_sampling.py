"""Seeded sampling is reproducible; degenerate filters reduce to greedy."""

from __future__ import annotations

from conftest import small_engine

import kvlab


def test_seeded_sampling_is_reproducible(model, chat_prompts):
    params = kvlab.SamplingParams(max_new_tokens=20, temperature=0.9, top_p=0.95, seed=7)
    a = small_engine(model).generate(chat_prompts[1:3], params)
    b = small_engine(model).generate(chat_prompts[1:3], params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    other = kvlab.SamplingParams(max_new_tokens=20, temperature=0.9, top_p=0.95, seed=8)
    c = small_engine(model).generate(chat_prompts[1:3], other)
    assert [o.token_ids for o in a] != [o.token_ids for o in c]


def test_top_k_one_and_tiny_top_p_are_greedy(model, chat_prompts):
    greedy = small_engine(model).generate(chat_prompts[2:4], kvlab.SamplingParams(16))
    for params in (
        kvlab.SamplingParams(16, temperature=1.5, top_k=1, seed=1),
        kvlab.SamplingParams(16, temperature=1.5, top_p=1e-6, seed=1),
    ):
        sampled = small_engine(model).generate(chat_prompts[2:4], params)
        assert [o.token_ids for o in sampled] == [o.token_ids for o in greedy]


def test_metrics_are_consistent(model, chat_prompts):
    out = small_engine(model).generate([chat_prompts[4]], kvlab.SamplingParams(10))[0]
    m = out.metrics
    assert m.arrival_s <= m.first_token_s <= m.finish_s
    assert m.ttft_s > 0 and m.tpot_s >= 0
    assert m.num_output_tokens == len(out.token_ids)
