"""Tensor parallelism measured: per-rank KV, all-reduces, token identity, speed.

Every tp runs as real processes on this machine (kvlab.parallel). On a CPU the ranks share
its cores, so tokens/s shows the cost of the collectives, not the speed-up GPUs get from
splitting the weights' reads across devices.
"""

from __future__ import annotations

import time

from kvlab.build import Engine
from kvlab.config import EngineConfig, SamplingParams
from kvlab.model.loading import LoadedModel
from kvlab.parallel import check_tensor_parallel


def valid_sizes(model: LoadedModel) -> list[int]:
    """Every tensor_parallel_size the model's heads allow."""
    cfg = model.config
    sizes = []
    for tp in range(1, cfg.num_attention_heads + 1):
        try:
            check_tensor_parallel(tp, cfg.num_attention_heads, cfg.num_key_value_heads)
        except ValueError:
            continue
        sizes.append(tp)
    return sizes


def run_tp(
    model: LoadedModel,
    prompts: list[str],
    sizes: list[int],
    max_new_tokens: int = 16,
    **config,
) -> dict[int, dict]:
    """One row per tp: KV per rank, collectives, greedy tokens equal to tp = 1, speed."""
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    rows, reference = {}, None
    for tp in sizes:
        start = time.perf_counter()
        engine = Engine(model, EngineConfig(cache="paged", tensor_parallel_size=tp, **config))
        started = time.perf_counter() - start
        try:
            outs = engine.generate(prompts, params)
            stats = engine.stats()
            pool = engine.cache.pool
            decode = stats[stats.phase == "decode"]
            tokens = [o.token_ids for o in outs]
            reference = tokens if reference is None else reference
            rows[tp] = {
                "kv_heads_per_rank": pool.spec.num_kv_heads,
                "kv_bytes_per_token_per_rank": pool.bytes_per_token,
                "kv_pool_bytes_per_rank": pool.bytes_per_token * pool.num_slots,
                "all_reduces_per_step": engine.runner.all_reduces // len(stats) if tp > 1 else 0,
                "identical_to_tp1": tokens == reference,
                "startup_s": round(started, 2),
                "decode_tok_per_s": round(decode.tokens.sum() / decode.step_s.sum(), 2),
            }
        finally:
            engine.close()
    return rows
