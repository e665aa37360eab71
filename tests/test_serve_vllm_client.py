"""vLLM's own benchmark client, `vllm bench serve` (from vLLM's venv, a client nobody
here wrote), against `kvlab serve` on 127.0.0.1: the random and the shared-prefix
dataset. It checks that every request completes with the tokens asked for and that
kvlab's /metrics, under vLLM's names, counts the shared prefixes as hits. Nothing is
timed here: benchmarks/serve_vs_vllm.py prints the speed figures.

Runs wherever vLLM's venv is ($KVLAB_VLLM_VENV, else .venv-vllm: `make peers`, which
`make test` runs first); skips, saying why, where it is absent. Each run imports vLLM
(30 s to 2 min here). The last test runs benchmarks/serve_vs_vllm.py --quick: both
servers as processes, `vllm serve` eager on a tiny model (a minute or two).
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")

from bench_scripts import load_script, vllm_tiny_checkpoint  # noqa: E402

import kvlab  # noqa: E402
from kvlab.peers.vllm_serve import bench_serve, vllm_cli_missing  # noqa: E402
from kvlab.serve import ServerThread, engine_config  # noqa: E402

pytestmark = pytest.mark.skipif(bool(vllm_cli_missing()), reason=str(vllm_cli_missing()))
PROMPTS, OUTPUT_LEN = 8, 8


def counter(server, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    page, _ = server.server.metrics.render()
    for family in text_string_to_metric_families(page.decode()):
        if family.name == name:
            return sum(s.value for s in family.samples if s.name.endswith("_total"))
    raise KeyError(name)


@pytest.mark.parametrize("dataset", ["random", "prefix_repetition"])
def test_vllm_bench_serve_against_kvlab_serve(tiny_model, dataset):
    config = engine_config("paged+prefix", max_model_len=1024, kv_budget_tokens=8192)
    engine = kvlab.Engine(tiny_model, config)
    with ServerThread(engine) as server:
        result = bench_serve(
            server.url, model=tiny_model.name, tokenizer=tiny_model.name, dataset=dataset,
            num_prompts=PROMPTS, output_len=OUTPUT_LEN, input_len=48, prefix_len=64,
            suffix_len=16, num_prefixes=2, timeout_s=300,
        )  # fmt: skip
        queries = counter(server, "vllm:prefix_cache_queries")
        hits = counter(server, "vllm:prefix_cache_hits")
        server.loop.call(lambda e: e.cache.check_integrity()).result(10)
        used = server.loop.call(lambda e: e.cache.allocator.num_used).result(10)
    assert (result["completed"], result["failed"]) == (PROMPTS, 0)
    assert result["total_output_tokens"] == PROMPTS * OUTPUT_LEN  # ignore_eos honoured
    assert queries == result["total_input_tokens"]
    assert used == 0
    if dataset == "prefix_repetition":
        # 2 prefixes of 64 tokens (4 blocks), 4 prompts each: every request after the
        # first of its prefix that is admitted once that prefix is computed hits 64 tokens
        assert hits >= 64 and hits % 16 == 0
    else:
        assert hits <= 16 * PROMPTS  # random prompts share little beyond a stray block


def test_serve_vs_vllm_quick(model, tmp_path, monkeypatch):
    """benchmarks/serve_vs_vllm.py --quick: `kvlab serve` and `vllm serve` (eager) on a
    tiny model vLLM's CPU attention takes, each driven once by `vllm bench serve` (the
    random dataset, 2 prompts of 64 tokens for 16), the JSON written to --out."""
    checkpoint = vllm_tiny_checkpoint(tmp_path / "tiny", model.tokenizer)
    # vLLM's helper processes (`python -m ...`) put their working directory first on
    # sys.path: in the checkout, kvlab's kernels/ would answer HF's `import kernels`
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "serve_vs_vllm.json"
    argv = ["--quick", "--model", str(checkpoint), "--threads", "1", "--out", str(out)]
    report = load_script("serve_vs_vllm").main([*argv, "--log-dir", str(tmp_path / "logs")])
    assert json.loads(out.read_text()) == report
    assert report["model"] == str(checkpoint.resolve())
    rows = report["rows"]
    assert [(r["server"], r["dataset"]) for r in rows] == [
        ("kvlab", "random"), ("vllm (eager)", "random"),
    ]  # fmt: skip
    for row in rows:
        assert (row["completed"], row["failed"]) == (2, 0)
        assert row["prefix_cache_queries"] == 2 * 64  # both count every prompt token
        assert row["ready_s"] > 0 and row["output_throughput"] > 0
    assert [r["block_size"] for r in rows] == [16, 128]  # each at its own
