"""Helpers for the tests that run benchmarks/*.py: import a script, and the tiny model in a
shape vLLM's CPU build can serve.

    main = load_script("serve_soak").main        # benchmarks/serve_soak.py, imported
    path = vllm_tiny_checkpoint(tmp_path, model.tokenizer)
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import torch

ROOT = Path(__file__).resolve().parents[1]


def load_script(name: str) -> ModuleType:
    """benchmarks/<name>.py, imported (not run)."""
    spec = importlib.util.spec_from_file_location(
        f"bench_{name}", ROOT / "benchmarks" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def vllm_tiny_checkpoint(path: Path, tokenizer) -> Path:
    """conftest's tiny model (2 layers, hidden size 64, 2 KV heads, wide weights, the
    embedded tokenizer) with 2 query heads instead of 4: head size 32, the smallest that
    vLLM's CPU attention takes (it refuses the tiny model's 16 at its first step); and
    2,048 positions, the max_model_len of benchmarks/serve_vs_vllm.py."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        vocab_size=tokenizer.vocab_size,
        tie_word_embeddings=True,
        initializer_range=0.3,
    )
    with torch.random.fork_rng():  # the seed of the tests that follow stays theirs
        torch.manual_seed(2)
        LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
