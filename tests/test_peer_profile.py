"""kvlab's step profile beside vLLM's (kvlab.experiments.peer_profile): phases split where
the last prompt is done, vLLM's operators counted under kvlab's parts, the rest
unaccounted; and `kvlab profile --peer vllm` for real (skipped without `.venv-vllm`)."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from kvlab.cli import main
from kvlab.experiments.peer_profile import (
    parts_table_vs_vllm,
    phase_table,
    vllm_part,
    vllm_parts,
)
from kvlab.experiments.step_profile import PARTS
from kvlab.peers.vllm_peer import VllmRun, vllm_missing
from kvlab.workloads import encode_requests, uniform_chat, write_jsonl


def _kvlab_steps(phases: list[str], step_ms: list[float]) -> pd.DataFrame:
    rows = []
    for i, (phase, ms) in enumerate(zip(phases, step_ms)):
        parts = dict.fromkeys((f"{p} ms" for p in PARTS), 0.0)
        parts["matmuls ms"], parts["attention ms"] = 0.6 * ms, 0.4 * ms
        rows.append({"step": i + 1, "phase": phase, "step_ms": ms, **parts})
    return pd.DataFrame(rows)


def _vllm_run(rows: list[tuple[float, int]], ops: list[tuple[str, float]]) -> VllmRun:
    return VllmRun(
        outputs=[],
        num_cached_tokens=[],
        num_preemptions=[],
        run_s=0.0,
        cpu_s=0.0,
        steps=len(rows),
        peak_running=0,
        peak_waiting=0,
        preemptions=0,
        step_rows=[
            {"step_ms": ms, "running": 2, "prompt_tokens": p, "generation_tokens": 2}
            for ms, p in rows
        ],
        ops=[{"op": name, "calls": 1, "self_ms": ms} for name, ms in ops],
    )


@pytest.mark.parametrize(
    ("op", "part"),
    [
        ("_C::onednn_mm", "matmuls"),
        ("aten::linear", "matmuls"),
        ("_C::paged_attention_v1", "attention"),
        ("_C_cache_ops::reshape_and_cache", "kv write"),
        ("_C::rms_norm", "other forward"),
        ("_C::silu_and_mul", "other forward"),
        ("aten::argmax", "sampling"),
        ("aten::add", "other forward"),
        ("llm_engine step: record_stats", "unaccounted"),
    ],
)
def test_vllm_operators_count_under_kvlabs_parts(op, part):
    assert vllm_part(op) == part


def test_phases_split_after_the_last_prompt():
    steps = _kvlab_steps(["prefill", "mixed", "decode", "decode"], [100, 50, 10, 10])
    run = _vllm_run([(80, 0), (40, 300), (8, 0), (8, 0), (8, 0)], [])
    table = phase_table(steps, run)
    assert table.loc["prompt phase", "kvlab steps"] == 2
    assert table.loc["prompt phase", "kvlab s"] == pytest.approx(0.15)
    assert table.loc["prompt phase", "vLLM steps"] == 2
    assert table.loc["decode phase", "vLLM s"] == pytest.approx(0.024)
    assert table.loc["whole run", "kvlab / vLLM time"] == pytest.approx(0.17 / 0.144)


def test_parts_add_up_to_the_wall_time():
    run = _vllm_run([(600, 10), (400, 0)], [("_C::onednn_mm", 500.0), ("_C::rms_norm", 100.0)])
    seconds = vllm_parts(run)
    assert seconds["matmuls"] == pytest.approx(0.5)
    assert seconds["other forward"] == pytest.approx(0.1)
    assert seconds["unaccounted"] == pytest.approx(0.4)
    table = parts_table_vs_vllm(_kvlab_steps(["prefill", "decode"], [300, 100]), run)
    assert table.loc["whole run", "vLLM s"] == pytest.approx(1.0)
    assert table.loc["whole run", "kvlab s"] == pytest.approx(0.4)
    assert table.loc["matmuls", "kvlab s"] == pytest.approx(0.24)


@pytest.mark.skipif(bool(vllm_missing()), reason=str(vllm_missing()))
def test_kvlab_profile_beside_vllm(model, tmp_path, capsys):
    workload, saved = tmp_path / "chat.jsonl", tmp_path / "profile.json"
    write_jsonl(encode_requests(model, uniform_chat(3, max_new_tokens=6)), workload)
    argv = ["profile", "--workload", str(workload), "--peer", "vllm", "--quiet"]
    assert main([*argv, "--save", str(saved)]) == 0
    printed = capsys.readouterr().out
    assert "kvlab beside vLLM" in printed and "whole run" in printed
    vllm = json.loads(saved.read_text())["vllm"]
    assert vllm["meta"]["mode"] == "one process"
    run = VllmRun(**vllm["run"])
    assert len(run.step_rows) == run.steps and sum(map(len, run.outputs)) == 18
    assert sum(row["prompt_tokens"] for row in run.step_rows) == sum(
        len(r.prompt) for r in encode_requests(model, uniform_chat(3, max_new_tokens=6))
    )
    seconds = vllm_parts(run)
    assert seconds["matmuls"] > 0 and seconds["attention"] > 0  # its own kernels, named
