"""The kernels checked against their references and timed (benchmarks/gpu_check.py, 1 and 2).

- `correctness`: every kernel against its torch reference (max abs error per codec and
  dtype; KV writes bit for bit).
- `copy_bandwidth`, `tuning`, `best_configs`, `bandwidth_sweep`: the device's copy
  bandwidth, a tuning sweep of the decode kernel, and its achieved bandwidth (bytes it
  must read / time) across context lengths and batch sizes, as a fraction of the copy's.

Each takes `quick` (tiny shapes, for the CPU smoke run). On CUDA the kernels run as
Triton programs; on CPU they need TRITON_INTERPRET=1 set before triton is imported, and
the bandwidth sweep times the torch reference instead. Only torch and triton needed.
"""

from __future__ import annotations

import time

import torch

from kvlab import kernels as K
from kvlab.kernels import bench as B

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
CODECS = (None, "int8", "fp8_e4m3", "fp8_e5m2")
# (heads, kv_heads, head_dim): the engine's model, and a Llama-3-8B-like layer
SHAPES = {"smollm2-135m": (9, 3, 64), "llama3-8b": (32, 8, 128)}
TINY = (4, 2, 16)  # --quick's shape


def bench_ms(fn, quick: bool) -> float:
    """Milliseconds per call of `fn` (kvlab.kernels.bench.bench_ms)."""
    return B.bench_ms(fn, DEVICE, reps=3 if quick else 10)


def copy_bandwidth(quick: bool) -> dict:
    """The device's copy bandwidth (read + write of a 2 GiB tensor; 64 MiB with quick)."""
    return B.copy_bandwidth(DEVICE, (64 << 20) if quick else (2 << 30))


def tolerance(dtype: torch.dtype) -> float:
    """tests/test_kernels.py's: relative to the output's largest value (at least 1)."""
    if dtype != torch.float32:
        return 2e-2  # probabilities rounded to bf16 for P @ V
    return 1e-4 if CUDA else 1e-5  # exp2 is approximate on the GPU


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def correctness(quick: bool) -> dict:
    """{"decode_attention": rows of max abs error per case, dtype, codec and split
    count, "kv_write": rows of whether the Triton write equals the reference bit for bit}."""
    if quick:
        cases = {"tiny-ragged": ([5, 40, 17], TINY, 4)}
        dtypes = [torch.float32]
    else:
        ragged = [17, 4000, 1, 4096, 300, 2049, 64, 3333] * 4
        cases = {
            "smollm2-ragged-32": (ragged, SHAPES["smollm2-135m"], 16),
            "llama3-8b-4k-8": ([4096] * 8, SHAPES["llama3-8b"], 16),
        }
        dtypes = [torch.bfloat16, torch.float32]
    out: dict[str, list[dict]] = {"decode_attention": [], "kv_write": []}
    for name, (lens, shape, block_size) in cases.items():
        for dtype in dtypes:
            for kv_codec in CODECS:
                args = B.decode_inputs(lens, shape, kv_codec, dtype, DEVICE, block_size)
                ref = K.paged_decode_attention_ref(*args).float()
                for splits in (1, None):
                    got = K.paged_decode_attention_triton(*args, splits).float()
                    err = (got - ref).abs().max().item()
                    size = ref.abs().max().item()
                    out["decode_attention"].append(
                        {
                            "case": name,
                            "dtype": _dtype_name(dtype),
                            "kv_codec": kv_codec or "model dtype",
                            "num_splits": splits or "auto",
                            "max_abs_err": err,
                            "ref_max_abs": size,
                            "pass": err <= max(1, size) * tolerance(dtype),
                        }
                    )
    for kv_codec in (*CODECS, "fp16", "bf16"):
        out["kv_write"].append(
            {"kv_codec": kv_codec or "model dtype", **_kv_write(kv_codec, quick)}
        )
    return out


def _kv_write(kv_codec: str | None, quick: bool) -> dict:
    """Whether the Triton KV write stores what the reference stores, bit for bit."""
    tokens = 12 if quick else 4096
    shape = TINY if quick else SHAPES["llama3-8b"]
    g = torch.Generator(device=DEVICE).manual_seed(7)
    dtype = torch.float32 if quick else torch.bfloat16
    k, v = (
        torch.randn(tokens, *shape[1:], generator=g, device=DEVICE, dtype=dtype) for _ in range(2)
    )
    slots = torch.randperm(2 * tokens, device=DEVICE)[:tokens]
    results = []
    for write in (K.kv_write_ref, K.kv_write_triton):
        store = B.storage_dtype(kv_codec, dtype)
        caches = [torch.zeros(2 * tokens, *shape[1:], dtype=store, device=DEVICE) for _ in "kv"]
        scales = [
            torch.zeros(2 * tokens, shape[1], dtype=torch.bfloat16, device=DEVICE) for _ in "kv"
        ]
        write(k, v, *caches, slots, *scales, kv_codec)
        results.append(caches + scales)
    same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(*results))
    return {"bitwise_equal": same}


def _timed_row(args, kv_codec: str | None, config: dict, quick: bool) -> dict:
    ms = bench_ms(lambda: K.paged_decode_attention_triton(*args, **config), quick)
    gb_s = B.bytes_moved(args) / ms / 1e6
    return {"kv_codec": kv_codec or "bf16", **config, "ms": ms, "gb_s": gb_s}


def tuning(quick: bool) -> list[dict]:
    """The decode kernel's knobs at 4k context x 32 sequences (engine model's shape): a
    grid of tile / warps / stages, then split counts around the best of them."""
    lens, shape = ([64] * 2, TINY) if quick else ([4096] * 32, SHAPES["smollm2-135m"])
    rows = []
    for kv_codec in (None, "int8", "fp8_e4m3"):
        dtype = torch.float32 if quick else torch.bfloat16
        args = B.decode_inputs(lens, shape, kv_codec, dtype, DEVICE)
        tiles = (16,) if quick else ((32, 64, 128) if kv_codec is None else (64, 128))
        configs = [
            {"tile": t, "num_warps": w, "num_stages": s, "num_splits": None}
            for t in tiles
            for w in ((4,) if quick else (4, 8))
            for s in ((2,) if quick else (2, 3))
        ]
        grid = [_timed_row(args, kv_codec, config, quick) for config in configs]
        best = min(grid, key=lambda row: row["ms"])
        rows += grid
        knobs = {k: best[k] for k in ("tile", "num_warps", "num_stages")}
        for splits in (1, 2) if quick else (1, 2, 4, 8, 16):
            rows.append(_timed_row(args, kv_codec, {**knobs, "num_splits": splits}, quick))
    return rows


def best_configs(rows: list[dict]) -> dict:
    """{codec: the fastest row's tile, num_warps, num_stages and num_splits} of `tuning`."""
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
    """The decode kernel's achieved bandwidth per shape, codec, context and batch (default
    and `best` configs; on CPU the torch reference's), as a fraction of `copy_gb_s`.
    Stops with a "skipped" row when time.monotonic() passes `deadline`."""
    if quick:
        contexts, batches, plan = (32, 128), (1, 4), {"tiny": (TINY, (None, "int8"))}
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
            pool = B.random_pool(most, *shape[1:], kv_codec, dtype, DEVICE)
            config = best.get(kv_codec or "bf16", {})
            for context in contexts:
                for batch in batches:
                    if time.monotonic() > deadline:
                        rows.append({"shape": shape_name, "skipped": "time budget"})
                        return rows
                    args = B.decode_inputs(
                        [context] * batch, shape, kv_codec, dtype, DEVICE, pool=pool
                    )
                    moved = B.bytes_moved(args)
                    row = {
                        "shape": shape_name,
                        "kv_codec": kv_codec or _dtype_name(dtype),
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
