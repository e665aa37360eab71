"""Tensor parallelism as real processes: greedy tokens equal tp = 1, KV split per rank."""

from __future__ import annotations

import pytest

import kvlab
from kvlab import EngineConfig, SamplingParams
from kvlab.parallel import check_tensor_parallel, kv_heads_per_rank
from kvlab.parallel.shard import kv_head_range, mlp_range

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], list(range(100, 140)), [3, 1, 4, 1, 5, 9, 2, 6], [42] * 20]


def outputs(model, prompts, params, **config):
    engine = kvlab.Engine(model, EngineConfig(max_model_len=256, **config))
    try:
        outs = engine.generate(prompts, params)
        engine.cache.check_integrity()
        free = engine.cache.num_available == engine.cache.num_blocks
        return [[s.token_ids for s in o.samples] for o in outs], engine, free
    finally:
        engine.close()


def test_bad_sizes_name_the_limit(tiny_model):
    with pytest.raises(ValueError, match="must divide the model's 4 attention heads"):
        kvlab.Engine(tiny_model, EngineConfig(tensor_parallel_size=3))
    with pytest.raises(ValueError, match="must be >= 1"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="needs tensor_parallel_size=1"):
        EngineConfig(tensor_parallel_size=2, speculative={"method": "layers"})
    with pytest.raises(ValueError, match="one must divide the other"):
        check_tensor_parallel(2, 6, 3)


def test_head_assignment():
    # The embedded model: 9 query heads, 3 KV heads.
    assert [kv_heads_per_rank(tp, 3) for tp in (1, 3, 9)] == [3, 1, 1]
    assert [kv_head_range(r, 9, 3).start for r in range(9)] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert [list(kv_head_range(r, 2, 4)) for r in range(2)] == [[0, 1], [2, 3]]
    assert sum(len(mlp_range(r, 9, 1536)) for r in range(9)) == 1536  # uneven split


@pytest.mark.parametrize("tp", [2, 4])  # 4 > the tiny model's 2 KV heads: replicated
def test_greedy_tokens_equal_one_process(tiny_model, tp):
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    config = dict(cache="paged", block_size=4, prefix_caching="hash")
    expected, single, _ = outputs(tiny_model, PROMPTS, params, **config)
    got, engine, free = outputs(tiny_model, PROMPTS, params, tensor_parallel_size=tp, **config)
    assert got == expected and free
    layers = len(engine.runner.layers)
    steps = len(engine.stats())
    assert engine.runner.all_reduces == 2 * layers * steps  # two per layer per forward
    per_rank = engine.cache.pool.bytes_per_token
    assert per_rank * min(tp, 2) == single.cache.pool.bytes_per_token  # 2 KV heads


def test_copies_and_swaps_mirror_on_every_rank(tiny_model):
    """n > 1 forks copy blocks on write; a small pool swaps: every rank's pool follows."""
    params = SamplingParams(max_new_tokens=24, n=2, ignore_eos=True)
    config = dict(cache="paged", block_size=3, admission="watermark", kv_budget_tokens=96,
                  preemption="swap", poison_freed=True)  # fmt: skip
    expected, _, _ = outputs(tiny_model, PROMPTS, params, **config)
    got, engine, free = outputs(tiny_model, PROMPTS, params, tensor_parallel_size=2, **config)
    assert got == expected and free
    assert engine.scheduler.swapped_bytes > 0 and engine.cache.copied_blocks > 0
