"""The long-context experiments (kvlab.experiments.longctx) and their benchmark script, on
the tiny model: the needle set, the budgets, and that the figures come out measured."""

from __future__ import annotations

import importlib.util

import pytest

import kvlab
from kvlab.config import EngineConfig
from kvlab.experiments import longctx, quality


def test_needle_set_places_one_fact_per_length_and_depth(tiny_model):
    needles = longctx.needle_set(tiny_model.tokenizer, [100, 300], [0.1, 0.9])
    assert [(n.context_tokens, n.depth) for n in needles] == [
        (100, 0.1), (100, 0.9), (300, 0.1), (300, 0.9)
    ]  # fmt: skip
    for needle in needles:
        fact = f"is {needle.answer}."
        assert needle.prompt.count(fact) == 1
        where = needle.prompt.index(fact) / len(needle.prompt)
        assert abs(where - needle.depth) < 0.25
        assert needle.prompt.rstrip().endswith("Answer with the number only.")
    with pytest.raises(ValueError, match="haystack has only"):
        longctx.needle_set(tiny_model.tokenizer, [10**6], [0.5])


def test_budget_config_splits_the_budget_per_policy():
    base = EngineConfig(cache="paged", block_size=16)
    window = longctx.budget_config(base, "window", 100)
    assert (window.retention, window.retention_window) == ("window", 112)  # whole blocks
    sinks = longctx.budget_config(base, "sinks", 128)
    assert (sinks.retention_sinks, sinks.retention_window) == (16, 112)
    h2o = longctx.budget_config(base, "h2o", 128)
    assert (h2o.retention_heavy, h2o.retention_window) == (64, 64)
    with pytest.raises(ValueError, match="policy='lru' is unknown"):
        longctx.budget_config(base, "lru", 128)


def test_memory_is_flat_for_every_policy_but_full(tiny_model):
    runner = kvlab.Engine(tiny_model, EngineConfig(cache="paged")).runner
    ids = quality.heldout_ids(tiny_model, 300)
    base = EngineConfig(cache="paged", block_size=16)
    configs = {"full": base} | {p: longctx.budget_config(base, p, 64) for p in longctx.POLICIES}
    table, trace = longctx.perplexity_table(runner, ids, configs, chunk=32)
    assert list(table["policy"]) == ["full", "window", "sinks", "h2o"]
    per_block = 16 * runner.kv_spec.bytes_per_token(runner.dtype)
    full = trace[trace["policy"] == "full"]
    assert full["kv_bytes"].iloc[-1] == 19 * per_block  # 299 tokens in 16-token blocks
    for policy in longctx.POLICIES:
        held = trace[trace["policy"] == policy]["kv_bytes"]
        assert held.max() <= (64 // 16 + 2) * per_block  # budget + the tail block
        later = held.iloc[len(held) // 2 :]  # flat in the context length (+- the tail block)
        assert later.max() - later.min() <= per_block
    assert table["ppl"].gt(1).all()


def test_recall_reports_peak_kv_per_needle(tiny_model):
    needles = longctx.needle_set(tiny_model.tokenizer, [150], [0.5])
    base = EngineConfig(cache="paged", chunked_prefill=True, max_num_batched_tokens=32,
                        max_model_len=512, kv_budget_tokens=512)  # fmt: skip
    full = longctx.recall(tiny_model, needles, base, max_new_tokens=4)
    kept = longctx.recall(tiny_model, needles, longctx.budget_config(base, "sinks", 48), 4)
    assert full["peak_kv_bytes"].iloc[0] >= full["full_kv_bytes"].iloc[0]
    assert kept["peak_kv_bytes"].iloc[0] < full["peak_kv_bytes"].iloc[0] / 2


def test_table_trace_shows_the_window_sliding(tiny_model):
    config = EngineConfig(cache="paged", block_size=8, retention="sinks", retention_window=24,
                          retention_sinks=8, chunked_prefill=True, max_num_batched_tokens=16,
                          max_model_len=256, kv_budget_tokens=256)  # fmt: skip
    trace = longctx.table_trace(tiny_model, list(range(100, 180)), config, max_new_tokens=16)
    last = trace[trace["step"] == trace["step"].max()]
    assert last[last["logical"] == 0]["state"].item() == "kept"  # the sink block
    assert (last["state"] == "dropped").sum() >= 6
    from kvlab.viz.retention import block_map_figure

    figure = block_map_figure(trace)
    assert len(figure.data[0].z) == trace["step"].max()


def test_long_context_benchmark_quick(tiny_model_path):
    spec = importlib.util.spec_from_file_location("long_context", "benchmarks/long_context.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    result = script.main(["--quick", "--model", str(tiny_model_path)])
    assert set(result["recall"]) == {f"{p}@{b}%" for p in longctx.POLICIES for b in (10, 25, 50)}
    assert 0 <= result["full_recall"] <= 1
    ppl = result["perplexity"]
    assert ppl["full"]["vs_full_pct"] == 0
    assert ppl["sinks"]["final_kv_mib"] < ppl["full"]["final_kv_mib"]
