"""The GPU check for kvlab's kernels: one command, under 5 minutes on one H200.

    python benchmarks/gpu_check.py            # on a CUDA machine: writes
                                              #   benchmarks/results/gpu_check.json
    python benchmarks/gpu_check.py --quick    # CPU smoke run (Triton interpreter, tiny
                                              #   shapes); writes to a temp dir

It needs only torch, triton and transformers (the engine part also imports kvlab, whose
pandas and tqdm come with most images; without them that part is recorded as skipped).
kvlab need not be installed: the kernels are loaded from ../kernels by path.

1. Correctness at full size: every kernel against its torch reference (max abs error per
   codec and dtype; KV writes bit for bit).
2. Bandwidth: the measured device copy bandwidth (read + write of a big tensor), a small
   tuning sweep of the decode kernel at 4k context x 32 sequences, then the decode
   kernel's achieved bandwidth (bytes it must read / time) across context lengths
   512..16k and batch sizes 1..64, as a fraction of the copy bandwidth.
3. The engine's decode throughput (paged cache; torch attention and kernel attention) vs
   HF `generate`, same prompts, greedy, same token counts. The embedded model when it is
   cached on the machine, else a model of its shape with random weights (throughput does
   not depend on the weights).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels on CPU

CODECS = (None, "int8", "fp8_e4m3", "fp8_e5m2")
# (heads, kv_heads, head_dim): the engine's model, and a Llama-3-8B-like layer
SHAPES = {"smollm2-135m": (9, 3, 64), "llama3-8b": (32, 8, 128)}


def load_kernels():
    """kvlab.kernels: installed, or loaded from ROOT/kernels under that name."""
    sys.path.insert(0, str(ROOT))
    try:
        return importlib.import_module("kvlab.kernels")
    except ImportError:
        pass
    for name in [n for n in sys.modules if n == "kvlab" or n.startswith("kvlab.")]:
        del sys.modules[name]  # a half-imported kvlab (a missing dependency)
    folder = ROOT / "kernels"
    spec = importlib.util.spec_from_file_location(
        "kvlab.kernels", folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    package = importlib.util.module_from_spec(spec)
    sys.modules["kvlab.kernels"] = package
    spec.loader.exec_module(package)
    return package


K = load_kernels()


# --- measuring (kvlab.kernels.bench) -------------------------------------------------------
DEVICE = "cuda" if CUDA else "cpu"
B = importlib.import_module("kvlab.kernels.bench")


def decode_args(lens, shape, kv_codec, dtype, device, block_size=16, pool=None, seed=0):
    return B.decode_inputs(lens, shape, kv_codec, dtype, device, block_size, pool, seed)


def bench_ms(fn, quick: bool) -> float:
    return B.bench_ms(fn, DEVICE, reps=3 if quick else 10)


def copy_bandwidth(quick: bool) -> dict:
    return B.copy_bandwidth(DEVICE, (64 << 20) if quick else (2 << 30))


bytes_moved = B.bytes_moved
random_pool = B.random_pool


def tolerance(dtype: torch.dtype) -> float:
    """tests/test_kernels.py's: relative to the output's largest value (at least 1)."""
    if dtype != torch.float32:
        return 2e-2  # probabilities rounded to bf16 for P @ V
    return 1e-4 if CUDA else 1e-5  # exp2 is approximate on the GPU


# --- 1. correctness ----------------------------------------------------------------------
def correctness(quick: bool) -> dict:
    device = "cuda" if CUDA else "cpu"
    if quick:
        cases = {"tiny-ragged": ([5, 40, 17], (4, 2, 16), 4)}
        dtypes = [torch.float32]
    else:
        ragged = [17, 4000, 1, 4096, 300, 2049, 64, 3333] * 4
        cases = {
            "smollm2-ragged-32": (ragged, SHAPES["smollm2-135m"], 16),
            "llama3-8b-4k-8": ([4096] * 8, SHAPES["llama3-8b"], 16),
        }
        dtypes = [torch.bfloat16, torch.float32]
    out = {"decode_attention": [], "kv_write": []}
    for name, (lens, shape, block_size) in cases.items():
        for dtype in dtypes:
            for kv_codec in CODECS:
                args = decode_args(lens, shape, kv_codec, dtype, device, block_size)
                ref = K.paged_decode_attention_ref(*args).float()
                for splits in (1, None):
                    got = K.paged_decode_attention_triton(*args, splits).float()
                    err = (got - ref).abs().max().item()
                    size = ref.abs().max().item()
                    out["decode_attention"].append(
                        {
                            "case": name,
                            "dtype": str(dtype).removeprefix("torch."),
                            "kv_codec": kv_codec or "model dtype",
                            "num_splits": splits or "auto",
                            "max_abs_err": err,
                            "ref_max_abs": size,
                            # tests/test_kernels.py's GPU tolerances
                            "pass": err <= max(1, size) * tolerance(dtype),
                        }
                    )
    tokens = 12 if quick else 4096
    shape = SHAPES["llama3-8b"] if not quick else (4, 2, 16)
    for kv_codec in (*CODECS, "fp16", "bf16"):
        g = torch.Generator(device=device).manual_seed(7)
        dtype = torch.float32 if quick else torch.bfloat16
        k, v = (
            torch.randn(tokens, *shape[1:], generator=g, device=device, dtype=dtype)
            for _ in range(2)
        )
        slots = torch.randperm(2 * tokens, device=device)[:tokens]
        results = []
        for write in (K.kv_write_ref, K.kv_write_triton):
            store = B.storage_dtype(kv_codec, dtype)
            caches = [torch.zeros(2 * tokens, *shape[1:], dtype=store, device=device) for _ in "kv"]
            scales = [
                torch.zeros(2 * tokens, shape[1], dtype=torch.bfloat16, device=device) for _ in "kv"
            ]
            write(k, v, *caches, slots, *scales, kv_codec)
            results.append(caches + scales)
        same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(*results))
        out["kv_write"].append({"kv_codec": kv_codec or "model dtype", "bitwise_equal": same})
    return out


# --- 2. bandwidth ------------------------------------------------------------------------
def tuning(quick: bool) -> list[dict]:
    """The decode kernel's knobs at 4k context x 32 sequences (engine model's shape)."""
    device = "cuda" if CUDA else "cpu"
    lens, shape = ([64] * 2, (4, 2, 16)) if quick else ([4096] * 32, SHAPES["smollm2-135m"])
    rows = []
    for kv_codec, dtype in (
        (None, torch.bfloat16),
        ("int8", torch.bfloat16),
        ("fp8_e4m3", torch.bfloat16),
    ):
        if quick:
            dtype = torch.float32
        args = decode_args(lens, shape, kv_codec, dtype, device)
        moved = bytes_moved(args)
        tiles = (16,) if quick else ((32, 64, 128) if kv_codec is None else (64, 128))
        configs = [
            {"tile": t, "num_warps": w, "num_stages": s, "num_splits": None}
            for t in tiles
            for w in ((4,) if quick else (4, 8))
            for s in ((2,) if quick else (2, 3))
        ]
        best = None
        for config in configs:
            ms = bench_ms(lambda c=config, a=args: K.paged_decode_attention_triton(*a, **c), quick)
            row = {"kv_codec": kv_codec or "bf16", **config, "ms": ms, "gb_s": moved / ms / 1e6}
            rows.append(row)
            best = row if best is None or ms < best["ms"] else best
        for splits in (1, 2) if quick else (1, 2, 4, 8, 16):
            config = {
                **{k: best[k] for k in ("tile", "num_warps", "num_stages")},
                "num_splits": splits,
            }
            ms = bench_ms(lambda c=config, a=args: K.paged_decode_attention_triton(*a, **c), quick)
            rows.append(
                {"kv_codec": kv_codec or "bf16", **config, "ms": ms, "gb_s": moved / ms / 1e6}
            )
    return rows


def best_configs(rows: list[dict]) -> dict:
    best: dict = {}
    for row in rows:
        key = row["kv_codec"]
        if key not in best or row["ms"] < best[key]["ms"]:
            best[key] = row
    return {
        k: {n: v[n] for n in ("tile", "num_warps", "num_stages", "num_splits")}
        for k, v in best.items()
    }


def bandwidth_sweep(quick: bool, copy_gb_s: float, best: dict, deadline: float) -> list[dict]:
    device = "cuda" if CUDA else "cpu"
    if quick:
        contexts, batches, plan = (32, 128), (1, 4), {"tiny": ((4, 2, 16), (None, "int8"))}
    else:
        contexts = (512, 1024, 2048, 4096, 8192, 16384)
        batches = (1, 4, 16, 32, 64)
        plan = {
            "smollm2-135m": (SHAPES["smollm2-135m"], (None, "int8", "fp8_e4m3")),
            "llama3-8b": (SHAPES["llama3-8b"], (None,)),
        }
    dtype = torch.float32 if quick else torch.bfloat16
    rows = []
    for shape_name, (shape, codecs) in plan.items():
        for kv_codec in codecs:
            most = max(contexts) * max(batches)
            pool = random_pool(most, *shape[1:], kv_codec, dtype, device)
            config = best.get(kv_codec or "bf16", {})
            for context in contexts:
                for batch in batches:
                    if time.monotonic() > deadline:
                        rows.append({"shape": shape_name, "skipped": "time budget"})
                        return rows
                    args = decode_args([context] * batch, shape, kv_codec, dtype, device, pool=pool)
                    moved = bytes_moved(args)
                    row = {
                        "shape": shape_name,
                        "kv_codec": kv_codec or str(dtype).removeprefix("torch."),
                        "context": context,
                        "batch": batch,
                        "bytes": moved,
                    }
                    if CUDA:
                        for label, kwargs in (("default", {}), ("tuned", config)):
                            ms = bench_ms(
                                lambda kw=kwargs, a=args: K.paged_decode_attention_triton(*a, **kw),
                                quick,
                            )
                            row[f"{label}_ms"] = ms
                            row[f"{label}_gb_s"] = moved / ms / 1e6
                            row[f"{label}_frac_of_copy"] = moved / ms / 1e6 / copy_gb_s
                    else:  # the CPU's decode path is the torch reference
                        ms = bench_ms(lambda a=args: K.paged_decode_attention_ref(*a), quick)
                        row.update(
                            reference_ms=ms,
                            reference_gb_s=moved / ms / 1e6,
                            reference_frac_of_copy=moved / ms / 1e6 / copy_gb_s,
                        )
                    rows.append(row)
            del pool
            if CUDA:
                torch.cuda.empty_cache()
    return rows


# --- 3. engine vs HF generate --------------------------------------------------------------
class IdTokenizer:
    """Stands in for a tokenizer when the model has random weights: ids in, ids out."""

    pad_token_id, eos_token_id, chat_template = 0, None, None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def engine_vs_hf(quick: bool, model_path: str | None) -> dict:
    import kvlab
    from kvlab.experiments.peers import hf_generate
    from kvlab.model.kernel_attention import KernelAttention

    device = "cuda" if CUDA else "cpu"
    try:
        if quick and model_path is None:
            raise LookupError("--quick: a 2-layer model, for the interpreter's sake")
        model = kvlab.load_model(model_path, device=device, progress=False)
        source = f"{model.name} (real weights)"
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
        hf = LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
        model = kvlab.LoadedModel(hf, IdTokenizer(), "random-smollm2-shape", 0.0)
        source = f"SmolLM2-135M shape, {layers} layers, random weights ({type(exc).__name__})"
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
            engine.runner.attention_fn = KernelAttention(engine.cache.block_size, backend="triton")
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


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


# --- main --------------------------------------------------------------------------------
def section(report: dict, name: str, fn):
    start = time.perf_counter()
    try:
        report[name] = fn()
    except Exception as exc:  # one broken part must not lose the others
        report[name] = {
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc(),
        }
    print(f"[{time.perf_counter() - start:6.1f} s] {name}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="CPU smoke run: tiny shapes")
    parser.add_argument("--out", type=Path, help="JSON path (default: see above)")
    parser.add_argument("--model", help="a local checkpoint dir (default: the embedded model)")
    parser.add_argument("--budget-s", type=float, default=270.0, help="stop the sweep after this")
    args = parser.parse_args()
    if not CUDA and not args.quick:
        parser.error("no CUDA device here: use --quick for the CPU smoke run")
    started = time.monotonic()
    import triton

    report: dict = {
        "device": torch.cuda.get_device_name()
        if CUDA
        else f"cpu ({platform.processor() or platform.machine()})",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "quick": args.quick,
        "versions": {
            "torch": torch.__version__,
            "triton": triton.__version__,
            "python": platform.python_version(),
        },
    }
    if CUDA:
        props = torch.cuda.get_device_properties(0)
        report["multiprocessors"] = props.multi_processor_count
    section(report, "copy_bandwidth", lambda: copy_bandwidth(args.quick))
    section(report, "correctness", lambda: correctness(args.quick))
    section(report, "tuning", lambda: tuning(args.quick))
    best = best_configs(report["tuning"]) if isinstance(report["tuning"], list) else {}
    report["best_configs"] = best
    copy_gb_s = report["copy_bandwidth"].get("gb_s", float("nan"))
    deadline = started + args.budget_s - (15 if args.quick else 60)  # leave the engine its time
    section(report, "bandwidth", lambda: bandwidth_sweep(args.quick, copy_gb_s, best, deadline))
    section(report, "engine_vs_hf", lambda: engine_vs_hf(args.quick, args.model))
    report["headline"] = headline(report)
    report["wall_s"] = time.monotonic() - started
    out = args.out or (
        Path(tempfile.gettempdir()) / "gpu_check_quick.json"
        if args.quick
        else ROOT / "benchmarks" / "results" / "gpu_check.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(json.dumps(report["headline"], indent=1, default=str))
    print(f"wrote {out}")


def headline(report: dict) -> dict:
    """The figures the closing note asks for."""
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


if __name__ == "__main__":
    main()
