"""Replaying a kvlab workload against an OpenAI-compatible endpoint (issue 15, part 5),
here `kvlab serve` on the tiny model: the same token ids give the same greedy text as an
in-process run, and the server's /metrics counters agree with its responses."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("fastapi")

import kvlab  # noqa: E402
from kvlab.cli import main  # noqa: E402
from kvlab.serve import ServerThread, engine_config  # noqa: E402
from kvlab.serve.replay import replay, served_model  # noqa: E402
from kvlab.workloads import Request, write_jsonl  # noqa: E402

SHARED = [400 + 3 * j for j in range(40)]  # 2 full blocks of 16 and a partial one


def workload() -> list[Request]:
    own = [[2000 + 17 * i + j for j in range(4 + 3 * i)] for i in range(6)]
    return [Request(SHARED + p, 10 + i, arrival_s=0.15 * i) for i, p in enumerate(own)]


def test_replay_matches_in_process_and_reads_the_servers_metrics(tiny_model):
    requests = workload()
    config = engine_config("paged+prefix", max_model_len=256, kv_budget_tokens=2048)
    alone = kvlab.Engine(tiny_model, engine_config("paged", max_model_len=256))
    expected = [o.text for o in alone.run(requests, ignore_eos=True)]
    with ServerThread(kvlab.Engine(tiny_model, config)) as server:
        assert served_model(server.url) == tiny_model.name
        result = asyncio.run(replay(server.url, tiny_model.name, requests, poll_s=0.05))
    assert [r.text for r in result.requests] == expected
    row = result.summary()
    assert row["requests"] == 6 and row["output_tokens"] == sum(10 + i for i in range(6))
    assert row["prefix_queries"] == sum(len(r.prompt) for r in requests)
    assert row["prefix_hits"] == sum(r.cached_tokens for r in result.requests)
    assert row["prefix_hits"] % 16 == 0 and row["preemptions"] == 0
    assert row["ttft_p50_s"] > 0 and result.samples
    # Chunks read in one burst (a busy machine) are microseconds apart, 0.0 at 4 decimals.
    assert 0 <= row["itl_p50_s"] <= row["itl_p99_s"] and row["e2e_p50_s"] > 0
    assert 0 <= row["peak_kv_usage"] <= 1

    with pytest.raises(ValueError, match="token ids"):
        asyncio.run(replay("http://127.0.0.1:9", "m", [Request("text", 4)]))


def test_compare_and_bench_take_an_endpoint(tiny_model, tmp_path, capsys):
    path = tmp_path / "w.jsonl"
    write_jsonl(workload()[:3], path)
    config = engine_config("paged+prefix", max_model_len=256, kv_budget_tokens=2048)
    with ServerThread(kvlab.Engine(tiny_model, config)) as server:
        common = ["--model", tiny_model.name, "--workload", str(path), "--device", "cpu"]
        common += ["--endpoint", server.url, "--json", "--quiet", "--max-model-len", "256"]
        assert main(["compare", "--configs", "paged+prefix", *common]) == 0
        compared = json.loads(capsys.readouterr().out)
        assert main(["bench", "--peers", "", "--configs", "paged", *common]) == 0
        benched = json.loads(capsys.readouterr().out)
    for out in (compared, benched):
        assert out["endpoint"]["endpoint"] == server.url
        assert out["endpoint"]["output_tokens"] == 10 + 11 + 12
    assert benched["systems"]["kvlab"]["output_tokens"] == 33


def test_kvlab_replay_needs_only_a_tokenizer(tiny_model, tmp_path, capsys):
    path, report = tmp_path / "w.jsonl", tmp_path / "replay.html"
    write_jsonl(workload()[:2], path)
    config = engine_config("paged+prefix", max_model_len=256, kv_budget_tokens=2048)
    with (
        ServerThread(kvlab.Engine(tiny_model, config)) as one,
        ServerThread(kvlab.Engine(tiny_model, engine_config("paged", max_model_len=256))) as two,
    ):
        argv = ["replay", "--endpoint", f"{one.url},{two.url}", "--tokenizer", tiny_model.name]
        assert main([*argv, "--workload", str(path), "--json", "--html", str(report)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [row["endpoint"] for row in rows] == [one.url, two.url]
    for row in rows:
        assert row["requests"] == 2 and row["output_tokens"] == 21
        assert row["prefix_queries"] == 2 * len(SHARED) + 4 + 7
    assert rows[1]["prefix_hits"] == 0  # no prefix caching on the second server
    page = report.read_text()
    assert "kvlab replay" in page and "KV-cache usage (its " in page and "waiting (dotted)" in page


def test_the_dashboard_replays_its_workload_at_an_endpoint(tiny_model):
    from kvlab.viz.dashboard import Dashboard

    dash = Dashboard(tiny_model, workload="uniform-chat", n=2, max_model_len=256)
    dash.workload_options["uniform-chat"] = {"max_new_tokens": 4}
    assert dash.replay() is None and "type the URL" in dash.status.value
    assert dash.replay("http://127.0.0.1:9") is None and "failed" in dash.status.value
    config = engine_config("paged+prefix", max_model_len=256, kv_budget_tokens=2048)
    with ServerThread(kvlab.Engine(tiny_model, config)) as server:
        dash.endpoint.value = server.url
        result = dash.replay()
    assert result.summary()["requests"] == 2 and result.summary()["output_tokens"] == 8
    (figure,) = dash.endpoint_box.children
    assert {trace.legendgroup for trace in figure.data} == {server.url}
    assert f"{server.url}: 2 requests, 8 output tokens" in dash.status.value
