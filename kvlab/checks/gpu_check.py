"""The GPU check's report (benchmarks/gpu_check.py): the kernels (kernel_check) and the
engine's decode throughput against HF `generate`, each part run on its own.

`gpu_report` runs every section; a section that raises is recorded as {"error", "traceback"}
and the others still run. Only the engine part needs kvlab's other dependencies (it imports
them when it runs); the kernel parts need torch and triton.
"""

from __future__ import annotations

import datetime
import platform
import time
import traceback
from collections.abc import Callable

import torch

from kvlab.checks import kernel_check
from kvlab.checks.kernel_check import CUDA, DEVICE


class IdTokenizer:
    """Stands in for a tokenizer when the model has random weights: ids in, ids out."""

    pad_token_id, eos_token_id, chat_template = 0, None, None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def _model(quick: bool, model_path: str | None):
    """(model, where it came from): the checkpoint (the embedded model by default), else,
    when it is not on this machine (or with quick and no path), a model of SmolLM2-135M's
    shape with random weights (throughput does not depend on the weights)."""
    import kvlab

    try:
        if quick and model_path is None:
            raise LookupError("--quick: a 2-layer model, for the interpreter's sake")
        model = kvlab.load_model(model_path, device=DEVICE, progress=False)
        return model, f"{model.name} (real weights)"
    except Exception as exc:  # not cached here (no network): same shape, random weights
        from transformers import LlamaConfig, LlamaForCausalLM

        layers = 2 if quick else 30
        config = LlamaConfig(
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=layers,
            num_attention_heads=9,
            num_key_value_heads=3,
            vocab_size=49152,
            max_position_embeddings=8192,
            rope_theta=100000.0,
            tie_word_embeddings=True,
            bos_token_id=1,
            eos_token_id=2,
        )
        torch.manual_seed(0)
        dtype = torch.bfloat16 if CUDA else torch.float32
        hf = LlamaForCausalLM(config).to(device=DEVICE, dtype=dtype).eval()
        source = f"SmolLM2-135M shape, {layers} layers, random weights ({type(exc).__name__})"
        return kvlab.LoadedModel(hf, IdTokenizer(), "random-smollm2-shape", 0.0), source


def engine_vs_hf(quick: bool, model_path: str | None) -> dict:
    """Output tok/s of the engine (paged cache; torch attention and kernel attention) and
    of HF `generate` on the same random prompts, greedy, the same token counts."""
    import kvlab
    from kvlab.model.kernel_attention import KernelAttention
    from kvlab.peers.hf import hf_generate

    model, source = _model(quick, model_path)
    n, new, prompt_len = (4, 8, 24) if quick else (32, 128, 256)
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, 49152, (prompt_len - prompt_len // 8 * (i % 4),), generator=g).tolist()
        for i in range(n)
    ]
    params = kvlab.SamplingParams(max_new_tokens=new, ignore_eos=True)
    config = kvlab.EngineConfig(
        cache="paged", block_size=16, max_model_len=1024, kv_budget_tokens=n * 512, max_num_seqs=n
    )

    def run_engine(kernels: bool) -> float:
        engine = kvlab.Engine(model, config)
        if kernels:
            engine.runner.use_attention(KernelAttention(engine.cache.block_size, backend="triton"))
        engine.generate(prompts[:2], kvlab.SamplingParams(max_new_tokens=2, ignore_eos=True))
        _sync()
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        _sync()
        return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)

    result = {
        "model": source,
        "workload": f"{n} prompts of ~{prompt_len} tokens x {new} new, greedy",
    }
    hf_generate(model, prompts[:2], [2, 2], batch_size=2)  # warm-up
    for name, fn in (
        ("kvlab-paged-torch", lambda: run_engine(False)),
        ("kvlab-paged-kernels", lambda: run_engine(True)),
        ("hf-generate", lambda: hf_generate(model, prompts, [new] * n, batch_size=n).tok_s),
    ):
        result[name + "_tok_s"] = max(fn() for _ in range(1 if quick else 2))
    result["kernels_over_hf"] = result["kvlab-paged-kernels_tok_s"] / result["hf-generate_tok_s"]
    result["torch_over_hf"] = result["kvlab-paged-torch_tok_s"] / result["hf-generate_tok_s"]
    return result


def section(report: dict, name: str, fn: Callable[[], object]) -> None:
    """report[name] = fn(), or the error it raised (one broken part must not lose the
    others); prints how long it took."""
    start = time.perf_counter()
    try:
        report[name] = fn()
    except Exception as exc:
        report[name] = {
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc(),
        }
    print(f"[{time.perf_counter() - start:6.1f} s] {name}", flush=True)


def gpu_report(quick: bool, model_path: str | None, budget_s: float) -> dict:
    """Every section of the check; the bandwidth sweep stops early enough to leave the
    engine part its time within `budget_s` seconds."""
    import triton

    started = time.monotonic()
    report: dict = {
        "device": torch.cuda.get_device_name()
        if CUDA
        else f"cpu ({platform.processor() or platform.machine()})",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "quick": quick,
        "versions": {
            "torch": torch.__version__,
            "triton": triton.__version__,
            "python": platform.python_version(),
        },
    }
    if CUDA:
        report["multiprocessors"] = torch.cuda.get_device_properties(0).multi_processor_count
    kc = kernel_check
    section(report, "copy_bandwidth", lambda: kc.copy_bandwidth(quick))
    section(report, "correctness", lambda: kc.correctness(quick))
    section(report, "tuning", lambda: kc.tuning(quick))
    best = kc.best_configs(report["tuning"]) if isinstance(report["tuning"], list) else {}
    report["best_configs"] = best
    copy_gb_s = report["copy_bandwidth"].get("gb_s", float("nan"))
    deadline = started + budget_s - (15 if quick else 60)  # leave the engine its time
    section(report, "bandwidth", lambda: kc.bandwidth_sweep(quick, copy_gb_s, best, deadline))
    section(report, "engine_vs_hf", lambda: engine_vs_hf(quick, model_path))
    report["headline"] = headline(report)
    report["wall_s"] = time.monotonic() - started
    return report


def headline(report: dict) -> dict:
    """The figures the closing note asks for: worst kernel error per codec and dtype,
    whether everything is correct, the decode bandwidth at 4k context, the tok/s."""
    h: dict = {}
    corr = report.get("correctness", {})
    if isinstance(corr, dict) and "decode_attention" in corr:
        worst: dict = {}
        for row in corr["decode_attention"]:
            key = f"{row['kv_codec']} ({row['dtype']})"
            worst[key] = max(worst.get(key, 0.0), row["max_abs_err"])
        h["max_abs_err_kernel_vs_reference"] = worst
        h["all_correct"] = all(r["pass"] for r in corr["decode_attention"]) and all(
            r["bitwise_equal"] for r in corr["kv_write"]
        )
    rows = [r for r in report.get("bandwidth", []) if isinstance(r, dict) and "context" in r]
    key = "tuned_frac_of_copy" if CUDA else "reference_frac_of_copy"
    at4k = [r for r in rows if r["context"] == 4096 and r["batch"] >= 32 and key in r]
    if at4k:
        h["decode_frac_of_copy_at_4k_batch_ge_32"] = {
            f"{r['shape']} {r['kv_codec']} B={r['batch']}": round(r[key], 3) for r in at4k
        }
    engine = report.get("engine_vs_hf", {})
    if "hf-generate_tok_s" in engine:
        h["engine_vs_hf_tok_s"] = {k: round(v, 1) for k, v in engine.items() if k.endswith("tok_s")}
    return h
