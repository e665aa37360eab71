"""`kvlab bench`: kvlab against HF generate and generate_batch on the same prompts."""

from __future__ import annotations

import json

import pytest

from kvlab.cli import main
from kvlab.experiments.bench import BenchResult, run_bench
from kvlab.peers.hf import choose_batch_size, hf_generate_batch
from kvlab.viz.bench import bench_figure
from kvlab.workloads import Request, uniform_chat, write_jsonl

SLOT = 46_080  # bytes of one token's K/V for SmolLM2-135M in fp32


def test_batch_size_a_user_would_pick():
    assert choose_batch_size([10] * 40, [5] * 40, None, SLOT) == 16  # the default
    assert choose_batch_size([10] * 3, [5] * 3, None, SLOT) == 3  # no more than requests
    # Padded rows of (30 + 10) tokens; a budget of 100 such rows' worth... and of 5.
    assert choose_batch_size([10, 30], [10, 2], 100 * 40 * SLOT, SLOT, default=64) == 2
    assert choose_batch_size([30] * 20, [10] * 20, 5 * 40 * SLOT, SLOT) == 5
    assert choose_batch_size([30] * 20, [10] * 20, 1, SLOT) == 1


def test_generate_batch_gives_each_request_its_own_length(model):
    prompts = [list(range(100, 120)), list(range(300, 310))]
    result = hf_generate_batch(model, prompts, [3, 5], num_blocks=2, page_size=64)
    assert [len(o) for o in result.outputs] == [3, 5] and result.batch_size is None


@pytest.fixture(scope="module")
def bench(model):
    return run_bench(model, uniform_chat(3, max_new_tokens=4), workload="uniform-chat")


def test_bench_runs_every_system_on_the_same_tokens(bench, tmp_path):
    result = bench.to_json()
    assert list(result) == ["systems", "ratios", "token_agreement"]
    assert list(result["systems"]) == ["kvlab", "hf-generate", "hf-generate-batch"]
    for row in result["systems"].values():
        assert list(row) == ["output_tokens", "wall_s", "tok_s", "cpu_percent"]
        assert 0 < row["cpu_percent"]
        assert row["output_tokens"] == 12
    assert list(result["ratios"]) == ["kvlab/hf-generate", "kvlab/hf-generate-batch"]
    # Greedy on the same prompts: every peer agrees with kvlab up to the first EOS.
    assert set(bench.meta["greedy_match_to_first_eos"].values()) == {1.0}
    assert list(result["token_agreement"]) == list(result["systems"])
    assert bench.systems["hf-generate"].batch_size == 3
    path = tmp_path / "bench.json"
    bench.save(path)
    loaded = BenchResult.load(path)
    assert loaded.to_json() == result and loaded.workload == "uniform-chat"
    assert loaded.systems["hf-generate"].batch_size == 3
    assert list(bench_figure(loaded).data[0].x) == list(result["systems"])


def test_bench_cli_json(tmp_path, capsys):
    workload = tmp_path / "tiny.jsonl"
    write_jsonl([Request(list(range(100, 120)), 3), Request(list(range(200, 210)), 2)], workload)
    saved, report = tmp_path / "saved.json", tmp_path / "bench.html"
    argv = [
        "bench",
        "--workload",
        str(workload),
        "--peers",
        "hf-generate",
        "--configs",
        "paged,paged+prefix",
        "--json",
        "--save",
        str(saved),
        "--html",
        str(report),
    ]
    assert main(argv) == 0  # progress bars and labels go to stderr, the JSON alone to stdout
    result = json.loads(capsys.readouterr().out)
    assert list(result["systems"]) == ["kvlab-paged", "kvlab-paged+prefix", "hf-generate"]
    assert all(row["output_tokens"] == 5 for row in result["systems"].values())
    assert set(result["ratios"]) == {"kvlab-paged/hf-generate", "kvlab-paged+prefix/hf-generate"}
    assert json.loads(saved.read_text())["details"]["hf-generate"]["batch_size"] == 2
    assert "Plotly.newPlot" in report.read_text()


def test_bench_rejects_unknown_peers(capsys):
    assert main(["bench", "--workload", "uniform-chat", "--peers", "sglang", "--quiet"]) == 2
    assert "unknown peer(s) ['sglang']" in capsys.readouterr().err


def test_median_ratios_summarise_every_round():
    from kvlab.experiments.bench import SystemResult

    systems = {
        "kvlab": SystemResult("kvlab", 100, 9.0, walls_s=[9.0, 12.0, 10.0]),
        "hf-generate": SystemResult("hf-generate", 100, 8.0, walls_s=[8.0, 15.0, 12.0]),
    }
    result = BenchResult("w", systems)
    assert result.ratios() == {"kvlab/hf-generate": round(8.0 / 9.0, 3)}  # fastest rounds
    assert result.median_ratios() == {"kvlab/hf-generate": 1.2}  # medians 10 and 12
    assert result.to_dict()["median_ratios"] == {"kvlab/hf-generate": 1.2}
