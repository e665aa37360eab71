"""Sliding-window layers (kvlab.model.pattern): kvlab's greedy tokens equal transformers'
on a model whose config mixes sliding-window and full-attention layers (Qwen2's
`layer_types`), and on a Llama given the same pattern by EngineConfig.attention_pattern,
through both attention paths, with prompts past the window, chunked prefill and prefix
hits (a window's mask over a context that is partly cached).
"""

from __future__ import annotations

import pytest
from conftest import WINDOW, as_qwen2, gemma3_reference, hf_greedy

import kvlab
from kvlab.model.pattern import model_pattern, parse_pattern


def test_a_pattern_is_its_unit_repeated_over_the_layers():
    assert parse_pattern("window=64*5,full", 12) == (64,) * 5 + (None,) + (64,) * 5 + (None,)
    assert parse_pattern("full", 3) == (None, None, None)
    assert parse_pattern("window=4, full*2", 4) == (4, None, None, 4)
    for bad, words in (("window=0", "must be a whole number >= 1"), ("local", "neither")):
        with pytest.raises(ValueError, match=words):
            parse_pattern(bad, 2)


def test_a_models_own_pattern_is_read_from_its_config():
    from types import SimpleNamespace as Config

    llama = Config(model_type="llama", num_hidden_layers=2)
    mistral = Config(model_type="mistral", num_hidden_layers=2, sliding_window=4096)
    types = ["sliding_attention", "full_attention"]
    qwen2 = Config(model_type="qwen2", num_hidden_layers=2, sliding_window=8, layer_types=types)
    assert model_pattern(llama) == (None, None) and model_pattern(mistral) == (4096, 4096)
    assert model_pattern(qwen2) == (8, None)
    llama4 = Config(model_type="llama4", num_hidden_layers=1, layer_types=["chunked_attention"])
    with pytest.raises(ValueError, match="chunked_attention"):
        model_pattern(llama4)


PROMPTS = [list(range(300, 337)), list(range(300, 320)) + [5, 6, 7], [9, 8, 7]]


@pytest.mark.parametrize("attention", ["torch", "kernels"])
@pytest.mark.parametrize("how", ["one-by-one", "batched chunks with prefix hits"])
def test_a_sliding_window_model_decodes_what_transformers_does(tiny_qwen, attention, how):
    config = kvlab.EngineConfig(cache="paged", attention=attention)
    if how != "one-by-one":
        config = kvlab.EngineConfig(
            cache="paged", attention=attention, prefix_caching="hash", block_size=4,
            chunked_prefill=True, max_num_batched_tokens=12,
        )  # fmt: skip
    engine = kvlab.Engine(tiny_qwen, config)
    assert engine.runner.windows == (WINDOW, None)  # the model's own pattern
    params = kvlab.SamplingParams(max_new_tokens=20, ignore_eos=True)
    if how == "one-by-one":
        outputs = [engine.generate([p], params)[0] for p in PROMPTS]
    else:
        engine.generate([PROMPTS[0]], params)  # its blocks are in the prefix cache now
        outputs = engine.generate(PROMPTS, params)
        assert sum(o.metrics.prefix_hit_tokens for o in outputs) > 0
    for prompt, out in zip(PROMPTS, outputs):
        assert out.token_ids == hf_greedy(tiny_qwen, prompt, 20)


def test_a_llama_given_a_pattern_decodes_as_transformers_with_the_same_masks(tiny_model):
    reference = kvlab.LoadedModel(
        as_qwen2(tiny_model.hf_model, ["sliding_attention", "full_attention"], WINDOW),
        tiny_model.tokenizer, "tiny-qwen2", 0.0,
    )  # fmt: skip
    windowed = kvlab.EngineConfig(cache="paged", attention_pattern=f"window={WINDOW},full")
    full = kvlab.Engine(tiny_model, kvlab.EngineConfig(cache="paged"))
    slid = kvlab.Engine(tiny_model, windowed)
    params = kvlab.SamplingParams(max_new_tokens=24, ignore_eos=True)
    prompt = PROMPTS[0]
    tokens = slid.generate([prompt], params)[0].token_ids
    assert tokens == hf_greedy(reference, prompt, 24)
    assert tokens != full.generate([prompt], params)[0].token_ids  # the window matters here
    assert full.generate([prompt], params)[0].token_ids == hf_greedy(tiny_model, prompt, 24)


def test_a_window_refuses_what_it_does_not_combine_with_yet(tiny_model):
    for name, value in (("batch_invariant", True), ("retention", "window")):
        config = kvlab.EngineConfig(cache="paged", attention_pattern="window=4,full")
        setattr(config, name, value)
        with pytest.raises(ValueError, match=f"needs {name}="):
            kvlab.Engine(tiny_model, config)
    with pytest.raises(ValueError, match="neither 'full' nor"):
        kvlab.Engine(tiny_model, kvlab.EngineConfig(attention_pattern="global"))


def test_the_real_model_with_gemmas_pattern_decodes_as_transformers(model, chat_prompts):
    """SmolLM2-135M given 5 sliding layers (32 tokens) to 1 full one, kernels path, a chat
    prompt of over 100 tokens: the same tokens as transformers running that pattern."""
    reference = gemma3_reference(model, 32)
    config = kvlab.EngineConfig(
        cache="paged", attention="kernels", attention_pattern="window=32*5,full"
    )
    engine = kvlab.Engine(model, config)
    prompt = model.tokenizer(" ".join(chat_prompts[:12]))["input_ids"]
    assert len(prompt) > 100
    params = kvlab.SamplingParams(max_new_tokens=16, ignore_eos=True)
    assert engine.generate([prompt], params)[0].token_ids == hf_greedy(reference, prompt, 16)


def test_the_reference_sees_a_runner_that_leaves_the_window_out(tiny_qwen, monkeypatch):
    """These tests can fail: a runner whose window layers read every key decodes other
    tokens than transformers on the prompt past the window."""
    import kvlab.model.runner as runner

    monkeypatch.setattr(runner, "windowed", lambda meta, window: meta)
    engine = kvlab.Engine(tiny_qwen, kvlab.EngineConfig(cache="paged"))
    params = kvlab.SamplingParams(max_new_tokens=20, ignore_eos=True)
    out = engine.generate([PROMPTS[0]], params)[0]
    assert out.token_ids != hf_greedy(tiny_qwen, PROMPTS[0], 20)
