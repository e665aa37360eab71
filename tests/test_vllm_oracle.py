"""vLLM as the oracle of kvlab's accounting (kvlab.checks.vllm_oracle): same model,
token ids, block size (32) and KV bytes, fp32, greedy.

Skipped where `make peers` cannot build `.venv-vllm` (vLLM ships builds for Linux x86-64
CPUs and CUDA machines only). One vLLM worker answers every run of the module, on one
core, while kvlab computes its side on the other.

Checked per request: prefix-hit tokens (vLLM's RequestOutput.num_cached_tokens) and greedy
tokens; per engine: KV capacity for a byte budget, peak running requests and preemptions.
The last test runs benchmarks/vllm_oracle.py --quick (one more vLLM worker, a tiny model).
"""

from __future__ import annotations

import json

import pytest
from bench_scripts import load_script, vllm_tiny_checkpoint

from kvlab.checks.vllm_oracle import BLOCK, BUDGETS, RUNS, block_bytes, run_oracle
from kvlab.peers.vllm_peer import vllm_missing

pytestmark = pytest.mark.skipif(bool(vllm_missing()), reason=str(vllm_missing()))

ALL_RUNS = [(w, a) for w, (_, arrivals) in RUNS.items() for a in arrivals]
SHARING_RUNS = [(w, a) for w, a in ALL_RUNS if w != "pressure"]


@pytest.fixture(scope="module")
def report(model):
    return run_oracle(model)


def test_kv_capacity_for_a_byte_budget(model, report):
    """Both carve the bytes into whole blocks of 32 tokens; vLLM keeps one of them back
    (its null block, which pads block tables), kvlab hands out all."""
    table = report.capacity()
    for name, (budget, _) in BUDGETS.items():
        row = table.loc[name]
        assert row.kvlab_blocks == row.vllm_blocks == budget // block_bytes(model)
        assert row.kvlab_tokens == row.vllm_logged_tokens == row.vllm_blocks * BLOCK
        assert row.vllm_usable_blocks == row.kvlab_blocks - 1


def test_prefix_caching_hits_the_shared_prefix(report):
    """The oracle's workloads share a prefix: one by one, every request after the first
    is served whole blocks of it from the cache, on both sides."""
    table = report.requests().set_index(["workload", "arrival"])
    for workload in ("doc-qa", "shared-prefix-chat"):
        hits = table.loc[(workload, "one-by-one")]
        assert hits.vllm_hit_tokens.iloc[0] == 0
        assert (hits.vllm_hit_tokens.iloc[1:] >= 4 * BLOCK).all()
        assert (hits.vllm_hit_tokens % BLOCK == 0).all()


@pytest.mark.parametrize("workload, arrival", SHARING_RUNS)
def test_prefix_hit_tokens_per_request(report, workload, arrival):
    """Prompt tokens served from the prefix cache, request by request (whole blocks of
    the shared preamble / system prompt), for the same arrival pattern."""
    _, outputs = report.kvlab[workload, arrival]
    theirs = report.vllm[workload, arrival]
    assert [o.metrics.prefix_hit_tokens for o in outputs] == theirs.num_cached_tokens


@pytest.mark.parametrize("workload, arrival", ALL_RUNS)
def test_greedy_tokens_identical(report, workload, arrival):
    """fp32, greedy, EOS ignored: every answer token for token, preempted ones included."""
    _, outputs = report.kvlab[workload, arrival]
    assert [o.token_ids for o in outputs] == report.vllm[workload, arrival].outputs


def test_peak_running_and_preemptions_at_a_tight_budget(report):
    """Eight chat answers of 40 tokens outgrow 14 usable blocks: with kvlab's default
    (watermark) admission both admit, run and preempt alike, request by request."""
    table = report.pressure()
    assert (table.kvlab == table.vllm).all()
    engine, outputs = report.kvlab["pressure", "together"]
    theirs = report.vllm["pressure", "together"]
    assert [o.metrics.preemptions for o in outputs] == theirs.num_preemptions


def test_the_quick_script(model, tmp_path, capsys):
    """benchmarks/vllm_oracle.py --quick on a tiny model vLLM's CPU attention takes: the
    tight budget's run alone (one vLLM engine), every table printed and saved. The tiny
    model's blocks are small, so the tight budget holds all eight answers at once."""
    checkpoint = vllm_tiny_checkpoint(tmp_path / "tiny", model.tokenizer)
    saved = tmp_path / "vllm_oracle.json"
    argv = ["--quick", "--model", str(checkpoint), "--save", str(saved)]
    data = load_script("vllm_oracle").main(argv)
    assert json.loads(saved.read_text()) == data
    assert "KV capacity" in capsys.readouterr().out
    (name,) = data["capacity"]
    row = data["capacity"][name]
    assert name == "tight" and row["kv_bytes"] == BUDGETS["tight"][0]
    assert row["kvlab_blocks"] == row["vllm_blocks"] == row["vllm_usable_blocks"] + 1
    assert row["kvlab_tokens"] == row["vllm_logged_tokens"] == row["vllm_blocks"] * BLOCK
    requests = data["requests"]
    assert [(r["workload"], r["request"]) for r in requests] == [("pressure", i) for i in range(8)]
    assert all(r["tokens_identical"] for r in requests)
    assert [r["kvlab_hit_tokens"] for r in requests] == [r["vllm_hit_tokens"] for r in requests]
    assert data["pressure"]["kvlab"] == data["pressure"]["vllm"]
    assert data["pressure"]["kvlab"]["peak_running"] == 8
