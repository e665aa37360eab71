"""Shared fixtures: the embedded model is loaded once per test session (from the user cache)."""

from __future__ import annotations

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
