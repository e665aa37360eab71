"""load_model(path) on tiny random Llama, Mistral and Qwen2 checkpoints saved to a temp dir."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy

import kvlab

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    vocab_size=49152,  # the embedded tokenizer's vocabulary
    rope_theta=5000.0,
)


def _tiny_config(kind: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    if kind == "llama":
        return LlamaConfig(**TINY, tie_word_embeddings=True)
    if kind == "mistral":
        return MistralConfig(**TINY, sliding_window=None)
    return Qwen2Config(**TINY, tie_word_embeddings=False)


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2"])
def tiny_dir(request, tmp_path_factory, model):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    hf = AutoModelForCausalLM.from_config(_tiny_config(request.param))
    if request.param == "qwen2":
        assert hf.model.layers[0].self_attn.q_proj.bias is not None  # qkv bias is exercised
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    model.tokenizer.save_pretrained(path)
    return path


def test_load_local_dir_and_match_hf(tiny_dir):
    loaded = kvlab.load_model(tiny_dir, device="cpu", progress=False)
    assert loaded.config.model_type in ("llama", "mistral", "qwen2")
    engine = kvlab.Engine(loaded, kvlab.EngineConfig(kv_budget_tokens=1024))
    prompts = [[1, 520, 9531, 198, 4093], [1, 2683, 359, 253, 5356, 5646, 11173, 3365]]
    params = kvlab.SamplingParams(max_new_tokens=24, ignore_eos=True)
    outputs = engine.generate(prompts, params)
    for prompt, out in zip(prompts, outputs):
        ref = hf_greedy(loaded, prompt, 24)
        assert out.token_ids[: len(ref)] == ref
    engine.cache.check_integrity()


def test_unsupported_architecture_is_rejected(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(
        tmp_path
    )
    with pytest.raises(ValueError, match="gpt2"):
        kvlab.load_model(tmp_path, device="cpu", progress=False)
