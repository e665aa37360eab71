"""Shared fixtures: the embedded model is loaded once per test session (from the user cache)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kvlab
from kvlab import texts

torch.manual_seed(0)


@pytest.fixture(scope="session")
def model() -> kvlab.LoadedModel:
    return kvlab.load_model(device="cpu", progress=False)


@pytest.fixture(scope="session")
def chat_prompts() -> list[str]:
    return texts.chat_prompts()


def small_engine(model, **overrides) -> kvlab.Engine:
    """An engine with a short max_model_len so naive reservations stay small."""
    config = dict(max_model_len=512, kv_budget_tokens=4 * 512)
    config.update(overrides)
    return kvlab.Engine(model, kvlab.EngineConfig(**config))


def hf_greedy(model, prompt_ids: list[int], new_tokens: int) -> list[int]:
    """HF transformers `generate`, greedy, one prompt: the reference kvlab must match."""
    ids = torch.tensor([prompt_ids])
    out = model.hf_model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=model.tokenizer.eos_token_id,
    )
    return out[0, len(prompt_ids) :].tolist()


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory, model) -> Path:
    """The directory of the tiny model (`tiny_model`): a checkpoint `load_model` reads."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(2)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        vocab_size=model.tokenizer.vocab_size,
        tie_word_embeddings=True,
        initializer_range=0.3,
    )
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(path)
    model.tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model(tiny_model_path) -> kvlab.LoadedModel:
    """A 2-layer random Llama with the embedded tokenizer: fast enough for property tests.

    Its weights are drawn wide (initializer_range=0.3, not HF's 0.02), so it attends
    sharply and its greedy tokens depend on every K/V it reads: an engine that restores
    zeros or reads a wrong slot changes its outputs (tests/test_mutations.py checks it).
    """
    return kvlab.load_model(tiny_model_path, device="cpu", progress=False)
