"""The scripts in benchmarks/, each run in its --quick mode on the tiny model.

Each script's `main(argv)` returns the JSON it prints; the checks are on what is
deterministic (counts, blocks, token equality), never on timings. The two that start
vLLM run where the other vLLM tests do: serve_vs_vllm in tests/test_serve_vllm_client.py,
vllm_oracle in tests/test_vllm_oracle.py.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from bench_scripts import ROOT, load_script


def run_script(name: str, model_path: Path, *extra: str) -> dict:
    """Run benchmarks/<name>.py's main with --quick on `model_path`."""
    return load_script(name).main(["--quick", "--model", str(model_path), *extra])


def test_paged_vs_naive(tiny_model_path, tmp_path, capsys):
    out = tmp_path / "paged_vs_naive.json"
    result = run_script("paged_vs_naive", tiny_model_path, "--out", str(out))
    assert json.loads(capsys.readouterr().out) == result == json.loads(out.read_text())
    assert set(result) == {
        "machine", "model", "workload", "budget_tokens", "caches",
        "peak_ratio_paged_over_naive", "identical_naive_paged16", "equality_subset",
    }  # fmt: skip
    naive, paged = result["caches"]["naive"], result["caches"]["paged16"]
    # The budget holds four max-context (1024-token) naive sequences; the six short
    # chat requests all fit in paged blocks at once.
    assert result["budget_tokens"] == 4 * 1024
    assert naive["peak_concurrent"] == 4 and paged["peak_concurrent"] == 6
    assert result["peak_ratio_paged_over_naive"] == 1.5
    assert naive["waste_frac_mean"] > 0.9 > 0.2 > paged["waste_frac_mean"] > 0
    assert naive["steps"] > paged["steps"]  # two waves against one
    assert result["identical_naive_paged16"] is True
    subset = result["equality_subset"]
    assert subset["requests"] == 2 and subset["new_tokens_each"] == 4
    assert subset["identical_to_naive"] == dict.fromkeys(
        ["naive", "paged1", "paged16", "paged64", "hf-generate"], True
    )


def test_prefix_sharing(tiny_model_path):
    result = run_script("prefix_sharing", tiny_model_path)
    off, hashed, radix = (result[f"prefix_caching={k}"] for k in (None, "hash", "radix"))
    assert off == {**off, "prompt_tokens_computed": off["prompt_tokens"]}
    assert set(off) == {"prompt_tokens", "prompt_tokens_computed", "peak_blocks"}
    for on in (hashed, radix):
        assert on["prompt_tokens"] == off["prompt_tokens"]
        assert on["prompt_tokens_computed"] < off["prompt_tokens_computed"]
        expected = 1 - on["prompt_tokens_computed"] / off["prompt_tokens_computed"]
        assert on["computed_reduction"] == pytest.approx(expected, abs=1e-4)
        assert on["computed_reduction"] > 0.3  # 2 of 3 requests reuse the ~300-token preamble
        assert on["peak_blocks"] < off["peak_blocks"]
        assert on["identical_outputs"] is True
    # Radix also copies the matching run of a partly filled block; hash shares full blocks.
    assert radix["prompt_tokens_computed"] <= hashed["prompt_tokens_computed"]
    ttft = result["ttft"]
    assert ttft["warm_hit_tokens"] >= 256 and ttft["warm_hit_tokens"] % 16 == 0
    assert ttft["cold_s"] > 0 and ttft["warm_s"] > 0
    forks = result["n4_sampling_peak_blocks"]
    assert forks["copy_on_write"] < forks["four_copies"]
    assert forks["saved_frac"] > 0.5  # one prompt + 4 tails against 4 prompts
    assert forks["same_samples"] is True


def test_scheduler_pressure(tiny_model_path):
    result = run_script("scheduler_pressure", tiny_model_path)
    over = result["oversubscription_4x"]
    assert 0 < over["budget_tokens"] <= over["total_demand_tokens"] / 4
    for mode in ("recompute", "swap"):
        run = over[mode]
        assert run["completed"] == run["requests"] == 8 and run["errors"] == 0
        assert run["preemptions"] > 0
        assert run["identical_to_unpressured"] is True
        assert run["budget_free_at_end"] is True and run["blocks_held_at_end"] == 0
    assert over["recompute"]["recomputed_tokens"] > 0 == over["recompute"]["swapped_bytes"]
    assert over["swap"]["swapped_bytes"] > 0 == over["swap"]["recomputed_tokens"]
    batching = result["static_vs_continuous"]
    assert batching["static"] > 0 and batching["continuous"] > 0
    ratio = batching["continuous"] / batching["static"]
    assert batching["ratio_continuous_over_static"] == pytest.approx(ratio, abs=1e-3)
    for run in result["chunked_prefill_decode_tpot"].values():
        assert 0 < run["tpot_p50_s"] <= run["tpot_p95_s"] <= run["tpot_max_s"]


def test_gpu_check_quick(tiny_model_path, tmp_path):
    """The GPU check's CPU smoke run (Triton interpreter, tiny shapes) in its own process:
    it sets TRITON_INTERPRET before importing triton. About a minute on a quiet 2-core
    machine; the timeout only guards against a hang."""
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "benchmarks/gpu_check.py", "--quick", "--out", str(out)]
    done = subprocess.run(
        [*command, "--model", str(tiny_model_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    for section in ("copy_bandwidth", "correctness", "tuning", "bandwidth", "engine_vs_hf"):
        part = report[section]  # a dict or a list of rows; {"error": ...} when it failed
        assert not (isinstance(part, dict) and "error" in part), part
    assert report["headline"]["all_correct"] is True
    assert report["engine_vs_hf"]["model"] == f"{tiny_model_path} (real weights)"
    assert all(v > 0 for v in report["headline"]["engine_vs_hf_tok_s"].values())


def test_bench_vs_hf_quick(tiny_model_path, tmp_path, capsys):
    saved = tmp_path / "bench.json"
    argv = ["--quick", "--model", str(tiny_model_path), "--json", "--save", str(saved)]
    assert load_script("bench_vs_hf").main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert list(result["systems"]) == ["kvlab", "hf-generate", "hf-generate-batch"]
    # --quick: 2 uniform chat prompts x 4 new tokens, ignore_eos, on every system
    assert all(row["output_tokens"] == 8 for row in result["systems"].values())
    full = json.loads(saved.read_text())
    assert full["workload"].endswith("uniform_chat_2x4.jsonl")
    assert full["details"]["kvlab"]["walls_s"] and len(full["details"]["kvlab"]["walls_s"]) == 1
    assert set(full["meta"]["greedy_match_to_first_eos"].values()) == {1.0}


def test_attention_pattern_quick(tiny_model_path):
    """All-full scores itself; a window longer than the text changes no loss at all; an
    8-token window on 63 tokens changes them."""
    result = run_script("attention_pattern", tiny_model_path)
    rows = {r["pattern"]: r for r in result["patterns"]}
    assert list(rows) == ["full", "window=8*5,full", "window=512*5,full", "window=8"]
    assert [r["sliding_layers"] for r in rows.values()] == [0, 2, 2, 2]  # of 2 layers
    for name in ("full", "window=512*5,full"):
        assert rows[name]["ppl"] == rows["full"]["ppl"] and rows[name]["top1_agreement"] == 1
        assert rows[name]["ppl_pct_low"] == rows[name]["ppl_pct_high"] == 0
    assert rows["window=8"]["ppl"] != rows["full"]["ppl"]
    assert {r["tokens"] for r in rows.values()} == {result["tokens_scored"]} == {63}


def test_hybrid_cache_quick(tiny_model_path):
    """On one budget, a window's groups hold more context than all full; a hit is whole
    blocks, so blocks longer than the chats' prompts never hit."""
    result = run_script("hybrid_cache", tiny_model_path)
    held = {row["system"]: row for row in result["held"]}
    assert len({row["kv_bytes"] for row in held.values()}) == 1  # the same budget
    assert held["groups"]["most_context_tokens"] > held["all full"]["most_context_tokens"]
    grain = {row["block_size"]: row for row in result["granularity"]}
    assert grain[16]["hit_pct"] > 0
    for size in (256, 1024):
        assert grain[size]["hit_pct"] == 0
        assert grain[size]["zero_hit_turns"] == grain[size]["later_turns"]
    assert {row["system"] for row in result["chat"]} == {"all full", "groups",
                                                           "groups, interval 16"}  # fmt: skip


def test_speculative_quick(tiny_model_path):
    result = run_script("speculative", tiny_model_path, "--no-vllm")  # tests/test_spec_vllm.py
    assert result["mismatches"] == []
    runs = result["runs"]
    # per workload: kvlab none, ngram k=2, layers k=1; hf none, prompt lookup k=2; then
    # the sweep at batch 1 and 2, without and with drafts
    assert [(r["system"], r["method"], r["k"]) for r in runs[:5]] == [
        ("kvlab", "none", 0), ("kvlab", "ngram", 2), ("kvlab", "layers", 1),
        ("hf", "none", 0), ("hf", "prompt-lookup", 2),
    ]  # fmt: skip
    assert len(runs) == 2 * 5 + 4 and all(r["identical"] for r in runs)
    assert all(r["output_tokens"] > 0 and r["tokens_per_forward"] >= 1.0 for r in runs)
    assert [r["batch_size"] for r in runs if r["part"] == "batch"] == [1, 1, 2, 2]


def test_cpu_kernels_quick():
    """Both prompt shapes through the C kernel and torch, equal to 1e-5 (bf16: to its
    rounding, through the AMX kernel where the CPU has it); the decode call on torch's
    OpenMP threads here (Linux) and on the library's pthreads in the child."""
    from kvlab.kernels import cpu_kernels_available
    from kvlab.kernels.cpu_prefill import amx_ready

    if not cpu_kernels_available():
        pytest.skip("the native CPU kernels did not build (no C compiler?)")
    result = load_script("cpu_kernels").main(["--quick", "--threads", "2"])
    assert [(r["cached"], r["new"]) for r in result["prompt"]] == [(0, 40), (60, 8)]
    assert all(r["max_abs_diff"] < 1e-5 and r["kernel_ms"] > 0 for r in result["prompt"])
    bf16 = result["prompt_bf16"]
    assert all(r["max_abs_diff"] < 5e-2 and r["dtype"] == "bfloat16" for r in bf16)
    assert {r["kernel"] for r in bf16} == {"amx" if amx_ready() else "tiles"}
    assert result["decode_bf16"]["dtype"] == "bfloat16"
    here, child = result["decode"]
    assert child["threads"] == "own" and here["threads"] in ("openmp", "own")
    assert all(d["decode_alone_ms"] > 0 for d in (here, child))


def test_cascade_quick():
    """Where the CPU has AMX-BF16: cascade attention and the decode kernel agree to bf16
    rounding on a shared prefix, both timed; elsewhere the script says why it measured
    nothing."""
    from kvlab.kernels import cpu_kernels_available
    from kvlab.kernels.cpu_prefill import amx_ready

    if not cpu_kernels_available():
        pytest.skip("the native CPU kernels did not build (no C compiler?)")
    result = load_script("cascade").main(["--quick", "--threads", "2"])
    if not amx_ready():
        assert "AMX" in result["skipped"]
        return
    (row,) = result["cascade"]
    assert row["shared"] == 256 and row["sequences"] == 8 and row["max_abs_diff"] < 2e-2
    assert row["decode_kernel_ms"] > 0 and row["cascade_ms"] > 0


def test_notebook_times_quick(tmp_path, capsys):
    """--quick times only a tiny notebook it writes itself: one row, the JSON on stdout,
    the progress line and the table on stderr."""
    out = tmp_path / "notebook_times.json"
    result = load_script("notebook_times").main(["--quick", "--threads", "1", "--out", str(out)])
    captured = capsys.readouterr()
    assert json.loads(captured.out) == result == json.loads(out.read_text())
    assert set(result) == {
        "machine", "load_average_at_start", "budget_s", "notebooks", "all_within_budget",
    }  # fmt: skip
    assert re.fullmatch(r"\S+, \d+ cores, 1 torch threads", result["machine"])
    (row,) = result["notebooks"]
    assert set(row) == {
        "notebook", "measured", "load_average_at_start", "wall_s", "cells", "status",
        "within_budget", "slowest_cell", "error",
    }  # fmt: skip
    assert (row["notebook"], row["cells"], row["status"], row["error"]) == (
        "00_tiny.ipynb", 2, "ok", None,
    )  # fmt: skip
    assert 0 < row["wall_s"] <= result["budget_s"] == 180 and row["within_budget"] is True
    assert result["all_within_budget"] is True
    assert "[1/1] 00_tiny.ipynb:" in captured.err and "<= 180 s" in captured.err


def test_notebook_times_update_replaces_only_the_rows_it_timed(tmp_path):
    """--update keeps the other rows of --out as they were, and its provenance block, and
    replaces the timed one."""
    out = tmp_path / "notebook_times.json"
    row = {"cells": 1, "status": "ok", "within_budget": True}
    old = [
        {"notebook": "01_old.ipynb", "wall_s": 9.0, **row},
        {"notebook": "00_tiny.ipynb", "wall_s": 0, **row},
    ]
    stamp = {"benchmark": "each notebook's wall time", "date": "2026-12-06"}
    out.write_text(json.dumps({"provenance": stamp, "notebooks": old}))
    result = load_script("notebook_times").main(["--quick", "--out", str(out), "--update"])
    assert result["provenance"] == stamp
    first, tiny = result["notebooks"]
    assert first == old[0] and tiny["notebook"] == "00_tiny.ipynb" and tiny["wall_s"] > 0
    assert json.loads(out.read_text()) == result
    with pytest.raises(SystemExit):  # nothing to update
        load_script("notebook_times").main(["--quick", "--update"])


def test_notebook_times_reports_errors_and_leaves_the_notebook(tmp_path):
    """A failing cell makes the row "error" with the cell and the exception; the timed
    notebook itself is never written (with store=True, only a run that went through is);
    over budget is not within it."""
    script = load_script("notebook_times")
    path = script.tiny_notebook(tmp_path)
    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell("1 / 0"))
    nbformat.write(nb, path)
    before = path.read_bytes()
    row = script.time_notebook(path, script.kernel_env(1))
    assert path.read_bytes() == before
    assert row["status"] == "error" and row["within_budget"] is False
    assert row["error"]["code_cell"] == 2 and "ZeroDivisionError" in row["error"]["message"]
    tiny = script.tiny_notebook(tmp_path)  # written again, without the failing cell
    late = script.time_notebook(tiny, script.kernel_env(1), budget_s=0)
    assert late["status"] == "ok" and late["within_budget"] is False
    failing = tmp_path / "failing.ipynb"
    failing.write_bytes(before)
    assert script.time_notebook(failing, script.kernel_env(1), store=True)["status"] == "error"
    assert failing.read_bytes() == before  # --store never writes a run that failed
    script.time_notebook(tiny, script.kernel_env(1), store=True)
    stored = nbformat.read(tiny, as_version=4).cells
    assert stored[2].outputs[0]["text"] == "332833500\n"  # this run's output, stored


SCRIPTS = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem != "stamp")
# stamp.py is a tool, not a benchmark.


# Every script's --help, run as `python benchmarks/<name>.py --help` would run it (as
# __main__, with its imports), all in one subprocess: torch is imported once, not once per
# script. It prints {name: [exit code, stdout, stderr]} as JSON.
HELP_ALL = """
import contextlib, io, json, runpy, sys
answers = {}
for name in sys.argv[1:]:
    path = f"benchmarks/{name}.py"
    out, err, code = io.StringIO(), io.StringIO(), 0
    sys.argv = [path, "--help"]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as done:
            code = done.code or 0
        except BaseException as error:
            code, _ = 1, print(repr(error), file=err)
    answers[name] = [code, out.getvalue(), err.getvalue()]
print(json.dumps(answers))
"""


@functools.cache  # one subprocess (~4 s) serves the two help tests of every script
def all_script_helps() -> dict[str, list]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-c", HELP_ALL, *SCRIPTS]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def script_help(name: str) -> str:
    """What `python benchmarks/<name>.py --help` prints (it must exit 0)."""
    code, out, err = all_script_helps()[name]
    assert code == 0, err[-3000:]
    return out


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_script_explains_itself(name):
    """`--help` prints the first line of the script's docstring (read, not imported:
    importing gpu_check on CPU sets TRITON_INTERPRET for the session)."""
    source = (ROOT / "benchmarks" / f"{name}.py").read_text()
    first = ast.get_docstring(ast.parse(source)).splitlines()[0]
    assert " ".join(first.split()) in " ".join(script_help(name).split())  # argparse may re-wrap


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_script_has_a_quick_mode(name):
    assert "--quick" in script_help(name)


# Imports refused in the next test: what a bare GPU image (torch, triton, transformers) lacks.
BARE_GPU = """
import importlib.abc, runpy, sys

class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {"pandas", "tqdm", "plotly", "ipywidgets", "hypothesis"}:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, Missing())
script = runpy.run_path("benchmarks/gpu_check.py", run_name="gpu_check")
script["load_kernels"]()
from kvlab.checks.gpu_check import headline
from kvlab.checks.kernel_check import correctness
print(headline({"correctness": correctness(quick=True)})["all_correct"])
"""


def test_gpu_check_kernels_need_only_torch_and_triton():
    """The kernel parts of the GPU check import and run (CPU: Triton's interpreter) where
    kvlab's other dependencies are missing."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", BARE_GPU], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == "True"


def test_tensor_parallel(tiny_model_path, capsys):
    result = run_script("tensor_parallel", tiny_model_path, "--sizes", "1", "2", "4")
    rows = result["tensor_parallel"]
    assert [rows[tp]["kv_heads_per_rank"] for tp in ("1", "2", "4")] == [2, 1, 1]
    assert all(row["identical_to_tp1"] for row in rows.values())
    assert rows["2"]["all_reduces_per_step"] == rows["4"]["all_reduces_per_step"] == 4


def test_disaggregated(tiny_model_path, capsys):
    setups = run_script("disaggregated", tiny_model_path)["setups"]
    assert set(setups) == {"colocated", "colocated+chunked", "disaggregated"}
    assert all(row["identical_to_colocated"] for row in setups.values())
    assert setups["disaggregated"]["bytes_moved"] > 0
    assert setups["disaggregated"]["transfers_rejected"] == 0


def test_serve_soak_quick(tiny_model_path, tmp_path, capsys):
    """8 streaming clients of two tenants, 2 requests each, on a server in this process."""
    out = tmp_path / "serve_soak.json"
    result = run_script("serve_soak", tiny_model_path, "--out", str(out))
    assert json.loads(capsys.readouterr().out) == result == json.loads(out.read_text())
    assert (result["clients"], result["requests"], result["distinct_prompts"]) == (8, 16, 4)
    assert result["unexpected"] == [] and result["ok"] is True
    assert result["completed"] > 0 and result["matched_solo"] == result["completed"]
    assert result["bad_answered_4xx"] == result["bad_requests"]
    assert result["server_up"] and result["leaked_blocks"] == result["crashes"] == 0
    assert result["audit"]["findings"] == [] and result["audit"]["cross_tenant_hits"] == 0


def test_tenant_flood_quick(tiny_model_path, tmp_path, capsys):
    """One round of each setting: 4 clients of A flood, B times 2 first tokens."""
    out = tmp_path / "tenant_flood.json"
    result = run_script("tenant_flood", tiny_model_path, "--out", str(out))
    printed = capsys.readouterr().out
    assert json.loads(printed) == result == json.loads(out.read_text())
    rows = result["rounds"]
    assert [(r["round"], r["setting"]) for r in rows] == [(0, "no limits"), (0, "limits")]
    assert all(len(r["b_ttft_s"]) == 2 and min(r["b_ttft_s"]) > 0 for r in rows)
    assert all(r["a_completed"] > 0 for r in rows)
    for name in ("no limits", "limits"):
        summary = result["summary"][name]
        assert 0 < summary["b_ttft_p50_s"] <= summary["b_ttft_p99_s"]
        assert len(summary["round_medians_s"]) == 1


def test_replicas_quick(tiny_model_path, tmp_path, capsys):
    """2 `kvlab serve` processes behind `kvlab route`, each policy once on 2 chats of 2
    turns; approx-prefix (the router's own record of what it sent where) sends a chat's
    second turn home, where it hits."""
    out = tmp_path / "replicas.json"
    result = run_script("replicas", tiny_model_path, "--out", str(out))
    assert json.loads(out.read_text()) == result
    assert f"wrote {out}" in capsys.readouterr().out
    assert result["provenance"]["rounds"] == 1 and result["vllm_router"] == "none"
    assert result["settings"]["replicas"] == 2
    runs = {r["policy"]: r for r in result["runs"]}
    assert list(runs) == ["round-robin", "least-loaded", "approx-prefix", "precise"]
    for run in runs.values():
        assert (run["turns"], run["output_tokens"]) == (4, 16)  # 2 chats x 2 turns x 4
        assert sum(run["replica_requests"].values()) == 4 and run["preemptions"] == 0
    assert runs["approx-prefix"]["later_turn_hit_rate"] > 0
    assert set(result["summary"]) == set(runs)
