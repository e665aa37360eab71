"""`kvlab compare`: config names, metrics, the JSON shape, the HTML report and the dashboard."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from kvlab.build import Engine
from kvlab.cli import main
from kvlab.experiments.compare import compare
from kvlab.experiments.metrics import METRICS, run_metrics
from kvlab.model.prompts import encode_prompt
from kvlab.presets import parse_budget, parse_config
from kvlab.texts import chat_prompts
from kvlab.viz.compare import comparison_figures
from kvlab.viz.dashboard import Dashboard
from kvlab.workloads import Request, uniform_chat, write_jsonl

SLOT = 46_080  # bytes of one token's K/V for SmolLM2-135M in fp32


def test_config_names():
    config = parse_config("paged+prefix+int8", kv_budget_bytes=10**6, max_model_len=256)
    assert (config.cache, config.prefix_caching, config.kv_codec) == ("paged", "hash", "int8")
    assert config.kv_budget_bytes == 10**6 and config.max_model_len == 256
    assert parse_config("paged+radix+bs32").prefix_caching == "radix"
    assert parse_config("paged+radix+bs32").block_size == 32
    assert parse_config("naive").cache == "naive"
    with pytest.raises(ValueError, match="unknown option 'prefx'"):
        parse_config("paged+prefx")
    with pytest.raises(ValueError, match="must start with a cache kind"):
        parse_config("vllm")
    with pytest.raises(ValueError, match="prefix_caching='hash' needs cache='paged'"):
        parse_config("naive+prefix")


def test_budget_in_bytes_or_tokens():
    assert parse_budget("64MiB", SLOT) == 64 * 2**20
    assert parse_budget("4096tok", SLOT) == 4096 * SLOT
    assert parse_budget("1000", SLOT) == 1000


def test_summarize_is_exact_on_a_known_frame():
    stats = pd.DataFrame(
        {
            "running": [2, 3, 1],
            "reserved_bytes": [100, 300, 100],
            "live_bytes": [50, 150, 100],
            "waste_bytes": [50, 150, 0],
            "prefix_query_tokens": [40, 20, 0],
            "prefix_hit_tokens": [0, 15, 0],
            "budget_bytes": [400, 400, 400],
            "preemptions": [0, 1, 2],
        }
    )
    requests = pd.DataFrame(
        {"output_tokens": [4, 1, 5], "ttft_s": [0.1, 0.2, 0.3], "tpot_s": [0.5, 0.0, 0.7]}
    )
    m = run_metrics(stats, requests, wall_s=2.0)
    assert list(m) == list(METRICS)
    assert (m["peak_concurrent"], m["reserved_bytes"], m["live_bytes"]) == (3, 300, 150)
    assert m["waste_frac"] == 0.4 and m["waste_frac_at_peak"] == 0.5
    assert m["prefix_hit_rate"] == 0.25 and m["preemptions"] == 2
    assert (m["output_tokens"], m["tok_s"], m["ttft_p50_s"]) == (10, 5.0, 0.2)
    assert m["tpot_p50_s"] == 0.6  # one-token outputs have no TPOT
    assert run_metrics(stats.drop(columns="preemptions"), requests, 2.0)["preemptions"] == 0


@pytest.fixture(scope="module")
def result(model):
    # 4 requests x 4 tokens, max_model_len 256: the budget holds 2 naive sequences.
    requests = uniform_chat(4, max_new_tokens=4)
    return compare(
        model,
        requests,
        ["naive", "paged", "paged+prefix"],
        budget_bytes=2 * 256 * SLOT,
        workload="uniform-chat",
    )


def test_compare_runs_every_config_on_the_same_budget(result):
    assert result.max_model_len == 256
    assert set(result.to_json()) == {"configs"}
    for name, metrics in result.to_json()["configs"].items():
        assert list(metrics) == list(METRICS), name
        assert metrics["output_tokens"] == 16 and metrics["budget_bytes"] == 2 * 256 * SLOT
    configs = result.to_json()["configs"]
    assert configs["naive"]["peak_concurrent"] == 2  # two 256-slot regions
    assert configs["paged"]["peak_concurrent"] == 4
    assert configs["naive"]["waste_frac"] > configs["paged"]["waste_frac"]
    outputs = [run.outputs for run in result.runs.values()]
    assert outputs[0] == outputs[1] == outputs[2]  # the cache never changes greedy tokens
    assert set(comparison_figures(result)) == {"memory", "capacity", "throughput", "latency"}
    by_step = comparison_figures(result, x="step")["memory"]
    steps = len(result.runs["naive"].stats)
    assert list(by_step.data[0].x) == list(range(1, steps + 1))  # the same on every machine
    assert by_step.layout.xaxis.title.text == "engine step"


def test_compare_cli_json_and_html(tmp_path, capsys):
    workload = tmp_path / "tiny.jsonl"
    write_jsonl([Request(list(range(100, 120)), 3), Request(list(range(200, 230)), 2)], workload)
    report = tmp_path / "report.html"
    argv = [
        "compare",
        "--workload",
        str(workload),
        "--configs",
        "naive,paged+prefix+int8",
        "--budget",
        "512tok",
        "--json",
        "--html",
        str(report),
    ]
    assert main(argv) == 0  # progress bars and labels go to stderr, the JSON alone to stdout
    result = json.loads(capsys.readouterr().out)
    assert list(result) == ["configs"]
    assert list(result["configs"]) == ["naive", "paged+prefix+int8"]
    assert all(list(m) == list(METRICS) for m in result["configs"].values())
    assert result["configs"]["naive"]["output_tokens"] == 5
    text = report.read_text()
    assert "<table" in text and "Plotly.newPlot" in text
    assert '<script src="http' not in text and len(text) > 10**6  # plotly.js is inlined


def test_compare_cli_reports_bad_input(capsys):
    assert main(["compare", "--workload", "no-such-workload", "--quiet"]) == 2
    assert "unknown workload 'no-such-workload'" in capsys.readouterr().err


def test_dashboard_draws_a_comparison_and_reruns_from_its_widgets(model, result, tmp_path):
    bench = tmp_path / "bench.json"
    bench.write_text(
        json.dumps(
            {
                "systems": {
                    "kvlab": {"output_tokens": 8, "wall_s": 1.0, "tok_s": 8.0},
                    "hf-generate": {"output_tokens": 8, "wall_s": 2.0, "tok_s": 4.0},
                },
                "ratios": {"kvlab/hf-generate": 2.0},
                "workload": "chat",
                "provenance": {"machine": "AMD EPYC, 2 cores"},
            }
        )
    )
    dash = Dashboard(
        model, initial=result, bench=bench, workload_options={"uniform-chat": {"max_new_tokens": 4}}
    )
    names = [t.name for t in dash.figure.data]
    assert "naive reserved" in names and "paged+prefix live" in names
    throughput = [t for t in dash.figure.data if t.type == "bar" and t.name in ("kvlab", "bench")]
    assert list(throughput[1].x) == ["bench: kvlab", "bench: hf-generate"]
    assert list(throughput[1].y) == [8.0, 4.0]
    titles = [a.text for a in dash.figure.layout.annotations]
    assert "throughput (grey: saved bench, chat, AMD EPYC, 2 cores)" in titles  # another run
    # Drive it as a user would: change the widgets, press Run.
    dash.workload.value, dash.n.value = "uniform-chat", 2
    dash.configs.value = ("naive", "paged")
    dash.budget.value = 32  # MiB
    dash.run_button.click()
    assert list(dash.result.runs) == ["naive", "paged"]
    capacity = dash.figure.data[-1]
    assert list(capacity.x) == ["naive", "paged"] and list(capacity.y) == [2, 2]
    dash.budget.value = 4  # MiB: below one naive sequence of 256 slots (11.25 MiB)
    dash.run_button.click()
    assert "error" in dash.status.value and list(dash.result.runs) == ["naive", "paged"]


def test_prompts_are_encoded_as_the_engine_encodes_them(model):
    engine = Engine(model, parse_config("paged", max_model_len=256, kv_budget_tokens=256))
    for prompt in chat_prompts()[:3]:
        assert encode_prompt(model.tokenizer, prompt) == engine.encode(prompt)
    assert encode_prompt(model.tokenizer, [5, 6]) == [5, 6]
