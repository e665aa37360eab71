"""The step profile: timing each part leaves the engine's tokens and code untouched, the
parts add up to the step, and the decode floor counts the bytes and FLOPs it claims."""

from __future__ import annotations

import json

import pandas as pd
import pytest

import kvlab.engine.core as core
import kvlab.engine.postprocess as postprocess
from kvlab import Engine, EngineConfig
from kvlab.cli import main
from kvlab.experiments.step_profile import (
    PARTS,
    DecodeFloor,
    MachineRates,
    decode_floor,
    parts_table,
    profile_steps,
)
from kvlab.workloads import Request

CONFIG = EngineConfig(cache="paged", kv_budget_tokens=16 * 40, max_model_len=256)


def _requests() -> list[Request]:
    prompts = [[1 + (i * 37 + j) % 900 for j in range(20 + 7 * i)] for i in range(3)]
    return [Request(prompt=p, max_new_tokens=6) for p in prompts]


def test_profiling_changes_no_token_and_unwraps_everything(tiny_model):
    metadata, sample = core.build_attention_metadata, postprocess.sample
    steps = profile_steps(tiny_model, _requests(), CONFIG)
    assert core.build_attention_metadata is metadata
    assert postprocess.sample is sample
    plain = Engine(tiny_model, CONFIG).run(_requests(), ignore_eos=True)
    assert sum(len(o.token_ids) for o in plain) == 18
    # One row per step that ran a forward; one prefill, then decodes of 3 sequences.
    assert list(steps["phase"]) == ["prefill"] + ["decode"] * 5
    assert steps["tokens"].tolist() == [20 + 27 + 34] + [3] * 5
    parts = steps[[f"{p} ms" for p in PARTS]]
    assert (parts >= 0).all().all()
    assert parts.sum(axis=1).to_numpy() == pytest.approx(steps["step_ms"].to_numpy(), rel=1e-6)
    decode = steps[steps["phase"] == "decode"]
    assert (decode["matmuls ms"] > 0).all() and (decode["kv gather ms"] > 0).all()
    # Context of decode step k: every prompt plus the k tokens sampled so far.
    assert decode["context_tokens"].tolist() == [81 + 3 * k for k in range(1, 6)]


def test_parts_table_shares_add_to_the_step(tiny_model):
    steps = profile_steps(tiny_model, _requests(), CONFIG)
    table = parts_table(steps)
    assert list(table.index) == [*PARTS, "step"]
    assert table.loc[list(PARTS), "share %"].sum() == pytest.approx(100)
    assert table.loc["step", "ms per step"] == pytest.approx(
        table.loc[list(PARTS), "ms per step"].sum()
    )
    with pytest.raises(ValueError, match="no mixed steps"):
        parts_table(steps, "mixed")


def test_decode_floor_counts_weights_kv_and_flops(tiny_model):
    config = tiny_model.config
    steps = pd.DataFrame(
        {"phase": ["decode", "decode"], "batch_seqs": [2, 4], "context_tokens": [100, 300]}
    )
    rates = MachineRates(bandwidth_gb_s=10.0, matmul_gflop_s=50.0, dtype="float32", threads=1)
    floor = decode_floor(tiny_model, steps, rates)
    hidden, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    head_dim = hidden // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    per_layer = hidden * (hidden + 2 * kv) + hidden * hidden + 3 * hidden * inter
    params = layers * per_layer + config.vocab_size * hidden  # + the LM head
    assert floor.weight_bytes == 4 * params
    assert floor.kv_bytes == 200 * layers * 2 * kv * 4  # mean context 200 tokens, K and V
    attention = 4 * 200 * config.num_attention_heads * head_dim * layers
    assert floor.gflop * 1e9 == pytest.approx(2 * 3 * params + attention)
    assert floor.bandwidth_ms == pytest.approx(1e3 * (floor.weight_bytes + floor.kv_bytes) / 1e10)
    assert floor.floor_ms == max(floor.bandwidth_ms, floor.compute_ms)
    assert isinstance(floor, DecodeFloor) and floor.to_json()["floor_ms"] == floor.floor_ms
    assert floor.matmul_gflop * 1e9 == pytest.approx(2 * 3 * params)  # 3 rows: 2 and 4 mean
    assert floor.matmuls_alone_ms == {} and floor.matmuls_best_ms is None  # not timed


def test_the_step_s_matmuls_are_timed_alone_on_every_path(tiny_model):
    """fp32: torch's F.linear and kvlab's oneDNN linears (AMX takes bf16 only)."""
    steps = pd.DataFrame({"phase": ["decode"], "batch_seqs": [5], "context_tokens": [50]})
    rates = MachineRates(bandwidth_gb_s=10.0, matmul_gflop_s=50.0, dtype="float32", threads=1)
    floor = decode_floor(tiny_model, steps, rates, time_matmuls=True)
    assert set(floor.matmuls_alone_ms) == {"F.linear", "oneDNN"}
    assert floor.matmuls_best_ms == min(floor.matmuls_alone_ms.values()) > 0
    assert floor.to_json()["matmuls_best_ms"] == floor.matmuls_best_ms


def test_machine_rates_are_positive():
    rates = MachineRates.measure(mib=8, n=128, repeats=2)
    assert rates.bandwidth_gb_s > 0 and rates.matmul_gflop_s > 0


def test_profile_command_prints_parts_and_floor(tiny_model_path, tmp_path, capsys):
    workload = tmp_path / "two.jsonl"
    lines = [json.dumps({"prompt": r.prompt, "max_new_tokens": 4}) for r in _requests()[:2]]
    workload.write_text("\n".join(lines) + "\n")
    args = ["profile", "--workload", str(workload), "--model", str(tiny_model_path), "--quiet"]
    assert main([*args, "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "decode steps" in out and "matmuls" in out and "decode floor:" in out
    assert "the step's matmuls alone" in out and "of the best rate alone" in out
