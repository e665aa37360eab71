"""kvlab's runner and engine against HF transformers on the embedded model (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy, small_engine

import kvlab
from kvlab.cache.pool import KVPool
from kvlab.model.metadata import build_attention_metadata
from kvlab.model.runner import ModelRunner

NEW_TOKENS = 32


@pytest.mark.smoke  # make test-fast's real-model test
def test_greedy_tokens_equal_hf_generate(model, chat_prompts):
    prompts = chat_prompts[:6]
    engine = small_engine(model)
    outputs = engine.generate(prompts, kvlab.SamplingParams(max_new_tokens=NEW_TOKENS))
    compared = 0
    for out in outputs:
        expected = hf_greedy(model, out.prompt_token_ids, NEW_TOKENS)
        # HF keeps its EOS token in the output; kvlab stops on it and returns it too.
        assert out.token_ids == expected[: len(out.token_ids)]
        assert len(out.token_ids) == len(expected)
        compared += len(out.token_ids)
    assert outputs[0].text == "The capital of France is Paris."
    assert compared >= 4 * NEW_TOKENS  # four answers ran to the limit


def test_ignore_eos_runs_to_max_new_tokens_and_matches_hf(model, chat_prompts):
    engine = small_engine(model)
    params = kvlab.SamplingParams(max_new_tokens=48, ignore_eos=True)
    out = engine.generate([chat_prompts[0]], params)[0]
    assert len(out.token_ids) == 48 and out.finish_reason == "length"
    ids = torch.tensor([out.prompt_token_ids])
    ref = model.hf_model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=48,
        min_new_tokens=48,
        do_sample=False,
        pad_token_id=0,
    )[0, ids.shape[1] :].tolist()
    # min_new_tokens bans EOS in HF; compare the prefix up to kvlab's first EOS.
    first_eos = out.token_ids.index(2) if 2 in out.token_ids else 48
    assert out.token_ids[:first_eos] == ref[:first_eos]


def _runner_logits(runner, ids):
    pool = KVPool(runner.kv_spec, len(ids), runner.dtype, runner.device)
    meta = build_attention_metadata([0], [len(ids)], [[0]], len(ids), runner.device)
    return runner.forward(torch.tensor(ids), meta, pool, all_logits=True), pool


def test_prefill_logits_match_hf(model, chat_prompts):
    runner = ModelRunner(model.hf_model)
    ids = model.tokenizer.encode(chat_prompts[3])
    ours, _ = _runner_logits(runner, ids)
    with torch.inference_mode():
        ref = model.hf_model(torch.tensor([ids])).logits[0]
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)


def test_decode_logits_match_full_recompute(model, chat_prompts):
    """Prefill then decode token by token through the cache == HF over the whole sequence."""
    runner = ModelRunner(model.hf_model)
    ids = model.tokenizer.encode(chat_prompts[5])
    capacity = len(ids) + 4
    pool = KVPool(runner.kv_spec, capacity, runner.dtype, runner.device)
    n = len(ids) - 4
    meta = build_attention_metadata([0], [n], [[0]], capacity, runner.device)
    runner.forward(torch.tensor(ids[:n]), meta, pool)
    with torch.inference_mode():
        ref = model.hf_model(torch.tensor([ids])).logits[0]
    for pos in range(n, len(ids)):
        meta = build_attention_metadata([pos], [1], [[0]], capacity, runner.device)
        step = runner.forward(torch.tensor([ids[pos]]), meta, pool)[0]
        torch.testing.assert_close(step, ref[pos], atol=2e-4, rtol=1e-4)
