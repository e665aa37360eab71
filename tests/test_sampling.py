"""Seeded sampling is reproducible; degenerate filters reduce to greedy; greedy rows take
the first maximal logit, as argmax."""

from __future__ import annotations

import torch
from conftest import small_engine

import kvlab
from kvlab.engine.sampler import sample
from kvlab.sequence import Sequence


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


def test_greedy_rows_take_the_first_maximal_logit_as_argmax():
    """sample() picks greedy tokens with max(dim) (faster than argmax on the CPU): ties go
    to the first index, NaN wins, as argmax, in fp32 and bf16."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 49152, generator=gen)
    logits[1, [5, 40000]] = 99.0  # a tie: index 5
    logits[2, [3, 4, 70]] = float("inf")
    logits[3, 123] = float("nan")
    seqs = [Sequence(i, [1, 2, 3], kvlab.SamplingParams(max_new_tokens=1)) for i in range(6)]
    for dtype in (torch.float32, torch.bfloat16):
        rows = logits.to(dtype)
        assert sample(rows, seqs) == rows.argmax(dim=-1).tolist()
    assert sample(logits, seqs)[1:4] == [5, 3, 123]
