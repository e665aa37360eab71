"""Issue figures for `kvlab serve` against `vllm serve` (issue 15, part 4): vLLM's own
benchmark client, `vllm bench serve`, drives each server in turn on 127.0.0.1 with the
same datasets (random, and shared-prefix `prefix_repetition`), the same model
(SmolLM2-135M-Instruct, fp32), the same KV budget, block size, batch limits and prefix
caching.

    python benchmarks/serve_vs_vllm.py [--servers kvlab,vllm] [--num-prompts 8]
                                       [--out benchmarks/results/serve_vs_vllm.json]

Needs vLLM's venv ($KVLAB_VLLM_VENV, else .venv-vllm in the checkout). Prints one row
per server and dataset: requests completed/failed, request throughput, output tok/s,
TTFT and ITL p50/p99 (ms) as vLLM's client measured them, and the prefix-cache queries
and hits each server's /metrics counted (the same series names on both). Each server runs
in its own process group and is stopped before the next starts.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import httpx

import kvlab
from kvlab.model.loading import EMBEDDED_MODEL, cache_dir
from kvlab.peers.vllm_serve import (
    bench_serve,
    server_process,
    vllm_cli_missing,
    vllm_env,
    vllm_serve_argv,
)
from kvlab.serve.server import free_socket

BUDGET_BYTES = 1 << 30  # 1 GiB of KV on both
MAX_MODEL_LEN = 2048
BLOCK_SIZE = 32  # vLLM's CPU build takes multiples of 32 only
MAX_NUM_SEQS = 8
MAX_BATCHED_TOKENS = 2048
KEYS = [
    "completed",
    "failed",
    "duration",
    "request_throughput",
    "output_throughput",
    "p50_ttft_ms",
    "p99_ttft_ms",
    "p50_itl_ms",
    "p99_itl_ms",
]


def kvlab_argv(port: int) -> list[str]:
    config = {
        "cache": "paged",
        "prefix_caching": "hash",
        "block_size": BLOCK_SIZE,
        "max_num_seqs": MAX_NUM_SEQS,
        "max_num_batched_tokens": MAX_BATCHED_TOKENS,
        "chunked_prefill": True,  # as vLLM schedules by default
    }
    return [
        sys.executable, "-m", "kvlab", "serve", "--port", str(port), "--device", "cpu",
        "--config", json.dumps(config), "--budget", str(BUDGET_BYTES),
        "--max-model-len", str(MAX_MODEL_LEN), "--log-level", "warning",
    ]  # fmt: skip


def prefix_counters(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    wanted = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions")
    values = {name: 0.0 for name in wanted}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        if family.name in wanted:
            values[family.name] += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return values


def run_server(name: str, argv: list[str], env, url: str, model_path: str, args, log_dir):
    rows = []
    started = time.perf_counter()
    with server_process(argv, url, log_dir / f"{name}_server.log", env=env, timeout_s=600):
        ready_s = time.perf_counter() - started
        for dataset in args.datasets.split(","):
            before = prefix_counters(url)
            result = bench_serve(
                url, model=EMBEDDED_MODEL, tokenizer=model_path, dataset=dataset,
                num_prompts=args.num_prompts, seed=args.seed,
            )  # fmt: skip
            after = prefix_counters(url)
            row = {"server": name, "dataset": dataset, "ready_s": round(ready_s, 1)}
            row |= {k: result.get(k) for k in KEYS}
            row |= {k.split(":")[1]: after[k] - before[k] for k in after}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", default="kvlab,vllm")
    parser.add_argument("--datasets", default="random,prefix_repetition")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="also write the JSON here")
    parser.add_argument("--log-dir", default=None, help="server logs (default: a temp dir)")
    args = parser.parse_args()
    missing = vllm_cli_missing()
    if missing:
        raise SystemExit(f"vllm bench serve cannot run: {missing}")
    kvlab.load_model(device="cpu", progress=False)  # converts the embedded model once
    model_path = str(cache_dir() / "models" / EMBEDDED_MODEL)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvlab-serve-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"server logs: {log_dir}", file=sys.stderr)
    rows = []
    for name in args.servers.split(","):
        sock = free_socket()
        port = sock.getsockname()[1]
        sock.close()
        url = f"http://127.0.0.1:{port}"
        if name == "kvlab":
            argv, env = kvlab_argv(port), None
        elif name == "vllm":
            argv = vllm_serve_argv(
                model_path, port, BUDGET_BYTES, MAX_MODEL_LEN, BLOCK_SIZE, MAX_NUM_SEQS,
                MAX_BATCHED_TOKENS, served_model_name=EMBEDDED_MODEL,
            )  # fmt: skip
            env = vllm_env(VLLM_CPU_OMP_THREADS_BIND="auto")
        else:
            raise SystemExit(f"--servers: {name!r} is not kvlab or vllm")
        rows += run_server(name, argv, env, url, model_path, args, log_dir)
    report = {
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, 2 cores shared",
        "model": EMBEDDED_MODEL,
        "settings": {
            "kv_budget_bytes": BUDGET_BYTES, "block_size": BLOCK_SIZE,
            "max_model_len": MAX_MODEL_LEN, "max_num_seqs": MAX_NUM_SEQS,
            "max_num_batched_tokens": MAX_BATCHED_TOKENS, "num_prompts": args.num_prompts,
            "random": "64 -> 16 tokens", "prefix_repetition": "2 prefixes x 256 + 32 -> 16",
        },
        "rows": rows,
    }  # fmt: skip
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
