"""`kvlab bench`: kvlab against HF generate and generate_batch on the same prompts; the
harness (warm-up pass, alternating rounds, medians, CPU per token, provenance) with a
fake vLLM side."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest

from kvlab.cli import main
from kvlab.experiments.bench import BenchResult, SystemResult, run_bench
from kvlab.peers.hf import choose_batch_size, hf_generate_batch, pages_for_all
from kvlab.peers.vllm_peer import VllmRun
from kvlab.presets import model_bytes_per_token
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


def test_generate_batch_gets_pages_for_every_request_at_once():
    """Its pool is counted in its own 256-token pages, one or more per request, plus the
    15% its FIFO scheduler keeps free before admitting another prefill: 16 chat requests
    of ~100 tokens get 19 pages (kvlab's budget for them, 1,792 tokens, is 7 pages)."""
    assert pages_for_all([40] * 16, [64] * 16) == 19  # 16 / 0.85, rounded up
    assert pages_for_all([100, 300], [64, 64]) == 4  # 1 + 2 pages, / 0.85
    assert pages_for_all([100] * 17, [56] * 17, safety_margin=0.15) == 20  # not 21
    assert pages_for_all([10], [5], page_size=16, safety_margin=0.0) == 1


def test_generate_batch_gives_each_request_its_own_length(model):
    prompts = [list(range(100, 120)), list(range(300, 310))]
    result = hf_generate_batch(model, prompts, [3, 5], num_blocks=2, page_size=64)
    assert [len(o) for o in result.outputs] == [3, 5] and result.batch_size is None


@pytest.fixture(scope="module")
def bench(model):
    return run_bench(
        model, uniform_chat(3, max_new_tokens=4), rounds=1, warmup=False, workload="uniform-chat"
    )


ROW = ["output_tokens", "wall_s", "tok_s", "median_wall_s", "median_tok_s", "spread"]
ROW += ["cpu_percent", "cpu_s_per_token"]


def test_bench_runs_every_system_on_the_same_tokens(bench, tmp_path):
    result = bench.to_json()
    assert list(result) == ["systems", "ratios", "median_ratios", "token_agreement"]
    assert list(result["systems"]) == ["kvlab", "hf-generate", "hf-generate-batch"]
    for row in result["systems"].values():
        assert list(row) == ROW
        assert 0 < row["cpu_percent"] and 0 < row["cpu_s_per_token"]
        assert row["output_tokens"] == 12
        assert row["wall_s"] <= row["median_wall_s"] and row["spread"] >= 1.0
    assert list(result["ratios"]) == ["kvlab/hf-generate", "kvlab/hf-generate-batch"]
    # Greedy on the same prompts: every peer agrees with kvlab up to the first EOS.
    assert set(bench.meta["greedy_match_to_first_eos"].values()) == {1.0}
    assert list(result["token_agreement"]) == list(result["systems"])
    assert bench.systems["hf-generate"].batch_size == 3
    # generate_batch's pool holds all three at once in its own pages (+ its free margin)
    assert bench.meta["hf_generate_batch_pages"] == 4 and bench.meta["hf_page_size"] == 256
    per_token = bench.meta["kv_budget_bytes_by_system"]["hf-generate-batch"] // (4 * 256)
    assert per_token == SLOT
    path = tmp_path / "bench.json"
    bench.save(path)
    loaded = BenchResult.load(path)
    again = loaded.to_json()  # walls are saved to the µs: derived figures stay put
    assert list(again) == list(result) and again["ratios"] == result["ratios"]
    assert again["median_ratios"] == pytest.approx(result["median_ratios"], abs=0.005)
    for name, row in result["systems"].items():
        numbers = {k: v for k, v in row.items() if isinstance(v, float)}
        assert {k: again["systems"][name][k] for k in numbers} == pytest.approx(numbers, rel=0.01)
        assert again["systems"][name]["output_tokens"] == row["output_tokens"]
    assert loaded.workload == "uniform-chat"
    assert loaded.systems["hf-generate"].batch_size == 3
    assert list(bench_figure(loaded).data[0].x) == list(result["systems"])


def test_bench_cli_json(tiny_model_path, tmp_path, capsys):
    workload = tmp_path / "tiny.jsonl"
    write_jsonl([Request(list(range(100, 120)), 3), Request(list(range(200, 210)), 2)], workload)
    saved, report = tmp_path / "saved.json", tmp_path / "bench.html"
    argv = [
        "bench",
        "--model",
        str(tiny_model_path),
        "--device",
        "cpu",
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
    argv += ["--rounds", "1"]
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
    systems = {
        "kvlab": SystemResult("kvlab", 100, 9.0, walls_s=[9.0, 12.0, 10.0], cpus_s=[2, 3, 4]),
        "hf-generate": SystemResult("hf-generate", 100, 8.0, walls_s=[8.0, 15.0, 12.0]),
    }
    result = BenchResult("w", systems)
    assert result.ratios() == {"kvlab/hf-generate": round(8.0 / 9.0, 3)}  # fastest rounds
    assert result.median_ratios() == {"kvlab/hf-generate": 1.2}  # medians 10 and 12
    assert result.to_dict()["median_ratios"] == {"kvlab/hf-generate": 1.2}
    kvlab = result.to_json()["systems"]["kvlab"]
    assert kvlab["median_wall_s"] == 10.0 and kvlab["median_tok_s"] == 10.0
    assert kvlab["spread"] == round(12.0 / 9.0, 3) and kvlab["cpu_s_per_token"] == 0.03
    table = result.table()
    assert list(table.loc["kvlab", ["min_wall_s", "median_wall_s", "spread"]]) == [9.0, 10.0, 1.33]
    assert table.loc["kvlab", "cpu_s_per_token"] == 0.03


class FakeVllmSide:
    """Stands in for kvlab.peers.vllm_bench.VllmBenchSide: no vLLM, a log of every call."""

    log: list = []
    pid = -1  # no worker process

    def __init__(self, eager: bool, block_size, budget: int):
        self.name = "vllm (eager)" if eager else "vllm"
        self.eager, self.block_size, self.budget = eager, block_size, budget

    @classmethod
    def start(cls, model, prompts, max_new, budget, *args, eager=True, block_size=32, **kw):
        side = cls(eager, block_size, budget)
        cls.log.append(("start", side.name, eager, block_size))
        return side

    def run(self, prompts, max_new_tokens, profile=False) -> VllmRun:
        self.log.append(("run", self.name, len(prompts), sum(max_new_tokens)))
        n = len(self.log)
        return VllmRun(
            outputs=[[7] * k for k in max_new_tokens],
            num_cached_tokens=[0] * len(prompts),
            num_preemptions=[0] * len(prompts),
            run_s=0.5 + 0.01 * n,  # every round a little slower
            cpu_s=1.0 + 0.01 * n,
            steps=max(max_new_tokens),
            peak_running=len(prompts),
            peak_waiting=0,
            preemptions=0,
        )

    def meta(self) -> dict:
        return {
            "version": "0.fake",
            "load_s": 1.0,
            "mode": "fake",
            "compiled": not self.eager,
            "compilation_mode": "NONE" if self.eager else "DYNAMO_TRACE_ONCE",
            "VLLM_CPU_OMP_THREADS_BIND": "auto",
            "omp_core_ids": [0],
            "block_size": self.block_size or 128,
            "kv_cache_memory_bytes": self.budget,
        }

    def close(self) -> None:
        self.log.append(("close", self.name))


@pytest.fixture
def fake_vllm(monkeypatch):
    import kvlab.experiments.bench as bench
    import kvlab.peers.vllm_bench as vllm_bench

    FakeVllmSide.log = []
    monkeypatch.setattr(vllm_bench, "VllmBenchSide", FakeVllmSide)
    monkeypatch.setattr(bench, "VLLM_BUSY_LOOP_S", 0.0)  # no fake worker spins
    return FakeVllmSide.log


def test_cpu_seconds_leave_out_the_vllm_workers():
    """kvlab's rounds count this process and its children, never a vLLM worker's tree."""
    import subprocess
    import sys

    from kvlab.experiments.bench import cpu_seconds

    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass"
    child = subprocess.Popen([sys.executable, "-c", spin + "\ntime.sleep(30)"])
    try:
        before_all, before_mine = cpu_seconds(), cpu_seconds(skip=(child.pid,))
        time.sleep(2.0)  # the child spends its 0.6 s of CPU
        assert cpu_seconds() - before_all >= 0.4
        assert cpu_seconds(skip=(child.pid,)) - before_mine < 0.3
    finally:
        child.kill()
        child.wait()


def test_vllm_peers_compiled_by_default_eager_labelled_full_warmup_alternating(
    tiny_model, fake_vllm
):
    requests = [Request(list(range(100, 110 + i)), 3 + i) for i in range(3)]
    result = run_bench(tiny_model, requests, peers=("vllm", "vllm-eager"))
    # vLLM at its defaults (compiled, its own block size); eager as a labelled peer
    assert fake_vllm[:2] == [("start", "vllm", False, None), ("start", "vllm (eager)", True, None)]
    assert list(result.systems) == ["kvlab", "vllm", "vllm (eager)"]
    runs = [e for e in fake_vllm if e[0] == "run"]
    # one untimed pass of the whole workload each, then 5 timed rounds (the peer default)
    assert len(runs) == 2 * (1 + 5) and all(e[2:] == (3, 12) for e in runs)
    assert result.meta["rounds"] == 5 and result.meta["warmup"]
    assert len(result.systems["vllm"].walls_s) == 5  # the warm-up pass is not among them
    assert min(result.systems["vllm"].walls_s) > 0.5 + 0.01 * 4  # not the warm-up's 0.5x
    forward = ["kvlab", "vllm", "vllm (eager)"]
    assert result.meta["round_orders"] == [forward, forward[::-1]] * 2 + [forward]
    timed = [e[1] for e in runs[2:]]  # rounds alternate: forward, then reversed
    assert timed == ["vllm", "vllm (eager)", "vllm (eager)", "vllm"] * 2 + ["vllm", "vllm (eager)"]
    vllm = result.to_json()["systems"]["vllm"]
    assert vllm["wall_s"] == round(min(result.systems["vllm"].walls_s), 3)  # the fastest round
    assert vllm["spread"] > 1.0 and vllm["cpu_s_per_token"] > 0
    assert result.to_json()["systems"]["kvlab"]["cpu_s_per_token"] > 0
    assert result.meta["vllm"]["compiled"] and not result.meta["vllm (eager)"]["compiled"]
    assert set(result.median_ratios()) == {"kvlab/vllm", "kvlab/vllm (eager)"}
    # without a budget, vLLM's KV holds the whole workload in its 128-token blocks + null
    per_token = model_bytes_per_token(tiny_model)
    assert result.meta["kv_budget_bytes_by_system"]["vllm"] == (3 + 1) * 128 * per_token
    assert fake_vllm[-2:] == [("close", "vllm"), ("close", "vllm (eager)")]


def test_bench_cli_saves_provenance_and_the_same_block_size_line(
    tiny_model_path, tmp_path, fake_vllm, capsys
):
    workload, saved = tmp_path / "tiny.jsonl", tmp_path / "saved.json"
    write_jsonl([Request(list(range(100, 120)), 3), Request(list(range(200, 210)), 2)], workload)
    argv = ["bench", "--model", str(tiny_model_path), "--device", "cpu", "--workload"]
    argv += [str(workload), "--peers", "vllm,vllm-eager", "--same-block-size", "--quiet"]
    assert main([*argv, "--save", str(saved)]) == 0
    printed = capsys.readouterr().out
    assert "vllm (eager) 0.fake: eager" in printed and "compiled (DYNAMO_TRACE_ONCE)" in printed
    assert "(median rounds)" in printed and "threads: kvlab and HF in one process" in printed
    data = json.loads(saved.read_text())
    assert list(data)[0] == "provenance"
    stamp = data["provenance"]
    for key in ("benchmark", "machine_class", "machine", "cpu_flags", "date", "command", "rounds"):
        assert stamp[key], key
    assert stamp["command"].startswith("kvlab bench --workload ")
    assert "--peers vllm,vllm-eager --same-block-size" in stamp["command"]
    assert stamp["rounds"] == 5 and "VLLM_CPU_OMP_THREADS_BIND=auto" in stamp["threads"]
    assert list(data["systems"]) == [
        "kvlab-paged+prefix",
        "kvlab-paged+prefix+bs128",
        "vllm",
        "vllm (eager)",
    ]
    assert all(len(d["walls_s"]) == 5 == len(d["cpus_s"]) for d in data["details"].values())
    assert BenchResult.load(saved).provenance == stamp


def test_the_vllm_side_runs_vllm_at_its_defaults(tiny_model, monkeypatch):
    """kvlab bench's vLLM: no enforce_eager and no block size from kvlab, unless asked."""
    import kvlab.peers.vllm_bench as vllm_bench
    from kvlab.peers import vllm_worker
    from kvlab.peers.vllm_peer import VllmEngine, VllmPeer

    started, stats = [], []
    engine = VllmEngine("0.fake", 1.0, 8, 128, None, [0])

    class Peer:
        inproc, threads_bind = False, "auto"

        def __init__(self, threads=None, inproc=False):
            pass

        def start(self, args, **options):
            started.append(args)
            stats.append(options.get("stats", False))
            return engine

    monkeypatch.setattr(vllm_bench, "VllmPeer", Peer)
    prompts, new = [list(range(100, 140))], [8]
    side = vllm_bench.VllmBenchSide.start(
        tiny_model, prompts, new, 10**6, eager=False, block_size=None
    )
    assert (
        side.name == "vllm" and not started[0]["enforce_eager"] and "block_size" not in started[0]
    )
    # stats logging off, as vllm.LLM runs (the timed runs must not pay for it)
    assert stats == [False] and side.meta()["log_stats"] is False
    side = vllm_bench.VllmBenchSide.start(tiny_model, prompts, new, 10**6, stats=True)
    # the profile's: eager at block 32, named as it ran; stats on for its per-step rows
    assert side.name == "vllm (eager, block 32)" and side.meta()["system"] == side.name
    assert started[1]["enforce_eager"] and started[1]["block_size"] == 32
    assert stats == [False, True] and side.meta()["log_stats"] is True
    # VllmPeer.start says it to the worker in the engine arguments
    asked = []
    peer = object.__new__(VllmPeer)
    peer._ask = lambda command: asked.append(command) or dataclasses.asdict(engine)
    peer.start({"model": "m"})
    peer.start({"model": "m"}, stats=True)
    assert [c["engine"]["disable_log_stats"] for c in asked] == [True, False]
    # the worker forces nothing: what is left out is vLLM's default (compiled), but for
    # stats logging, off as vllm.LLM has it
    assert "enforce_eager" not in vllm_worker.engine_arguments({"model": "m"})
    assert vllm_worker.engine_arguments({"model": "m"})["disable_log_stats"] is True
    assert vllm_worker.engine_arguments({"enforce_eager": True})["enforce_eager"] is True


def test_vllm_names_say_how_it_ran():
    from kvlab.peers.vllm_peer import vllm_system_name

    assert vllm_system_name() == vllm_system_name(block_size=128) == "vllm"
    assert vllm_system_name(eager=True) == "vllm (eager)"
    assert vllm_system_name(eager=True, block_size=32) == "vllm (eager, block 32)"
    assert vllm_system_name(block_size=32) == "vllm (block 32)"
