"""`kvlab bench --peers vllm`: vLLM's offline engine beside kvlab on the same token ids.

Skipped where `make peers` cannot build `.venv-vllm`. One vLLM engine at its defaults
(multiprocess, compiled with torch.compile, block size 128) serves the whole test, on the
tiny model in a shape vLLM's CPU build serves (tests/bench_scripts.py): torch.compile's
time grows with the model's graph, and on 2 cores the real model's compile alone takes
minutes. The real model's compiled runs are the saved comparisons in benchmarks/results/.
"""

from __future__ import annotations

import json

import pytest
from bench_scripts import vllm_tiny_checkpoint

from kvlab.cli import main
from kvlab.experiments.bench import BenchResult
from kvlab.peers.vllm_peer import vllm_missing
from kvlab.workloads import encode_requests, uniform_chat, write_jsonl

pytestmark = pytest.mark.skipif(bool(vllm_missing()), reason=str(vllm_missing()))


def test_bench_cli_runs_vllm_on_the_same_tokens(model, tmp_path, capsys):
    workload, saved = tmp_path / "chat.jsonl", tmp_path / "bench.json"
    checkpoint = vllm_tiny_checkpoint(tmp_path / "tiny", model.tokenizer)
    write_jsonl(encode_requests(model, uniform_chat(3, max_new_tokens=6)), workload)
    argv = ["bench", "--workload", str(workload), "--model", str(checkpoint)]
    argv += ["--peers", "vllm", "--quiet"]
    assert main([*argv, "--rounds", "2", "--json", "--save", str(saved)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert list(printed["systems"]) == ["kvlab", "vllm"]
    assert {row["output_tokens"] for row in printed["systems"].values()} == {18}
    assert list(printed["ratios"]) == ["kvlab/vllm"]
    # fp32, greedy, EOS ignored: vLLM's answers equal kvlab's token for token.
    assert printed["token_agreement"]["vllm"] == 1.0
    assert printed["systems"]["vllm"]["cpu_percent"] > 0
    result = BenchResult.load(saved)
    vllm = result.meta["vllm"]
    assert vllm["load_s"] > 0 and vllm["prefix_caching"]
    # vLLM at its defaults: compiled (not enforce_eager) and its CPU build's block size
    assert vllm["compiled"] and vllm["compilation_mode"] == "DYNAMO_TRACE_ONCE"
    assert vllm["block_size"] == 128 and vllm["block_size_chosen_by"] == "vLLM"
    assert vllm["VLLM_CPU_OMP_THREADS_BIND"] == "auto" and vllm["dtype"] == "float32"
    assert vllm["log_stats"] is False and vllm["system"] == "vllm"  # as vllm.LLM runs
    assert len(result.systems["vllm"].walls_s) == 2  # alternating rounds, generation only
    assert result.systems["vllm"].cpu_s_per_token > 0
    assert "VLLM_CPU_OMP_THREADS_BIND=auto" in result.provenance["threads"]
    # vLLM's KV: the whole workload in its 128-token blocks, plus its null block, carved
    # into blocks of 128 fp32 tokens (2 layers x 2 KV heads x 32 x K and V x 4 bytes each).
    assert vllm["kv_cache_memory_bytes"] == 4 * 128 * 1_024
    assert vllm["num_blocks"] == 4


def test_the_vllm_worker_starts_without_kvlabs_paths(monkeypatch):
    """PYTHONPATH with kvlab's root (as `make notebook-times` gives its kernels) would let
    kvlab's kernels/ folder answer transformers' `import kernels` in vLLM's venv."""
    import kvlab.peers.vllm_peer as peer

    seen = {}

    def popen(command, env, **kwargs):
        seen.update(env)
        raise RuntimeError("stop before starting vLLM")

    monkeypatch.setenv("PYTHONPATH", str(peer.vllm_venv().parent))
    monkeypatch.setattr(peer, "vllm_missing", lambda: None)
    monkeypatch.setattr(peer.subprocess, "Popen", popen)
    with pytest.raises(RuntimeError, match="stop before"):
        peer.VllmPeer(threads=1)
    assert "PYTHONPATH" not in seen and seen["VLLM_NO_USAGE_STATS"] == "1"
