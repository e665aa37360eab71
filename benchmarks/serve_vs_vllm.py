"""Issue figures for `kvlab serve` against `vllm serve` (issue 15, part 4): vLLM's own
benchmark client, `vllm bench serve`, drives each server in turn on 127.0.0.1 with the
same datasets (random, and shared-prefix `prefix_repetition`), the same model
(SmolLM2-135M-Instruct, fp32), the same KV budget, batch limits and prefix caching, on
the same cores.

    python benchmarks/serve_vs_vllm.py [--servers kvlab,vllm] [--num-prompts 8]
        [--threads N] [--vllm-eager] [--vllm-block-size 32]
        [--out benchmarks/results/serve_vs_vllm.<machine class>.json]
    python benchmarks/serve_vs_vllm.py --quick --model PATH --out /tmp/serve_vs_vllm.json

Each server runs at its own defaults but for those shared settings: kvlab serve at its
block size (16), with chunked prefill (as vLLM schedules); vllm serve compiled
(torch.compile, its default: the first start compiles for a minute or more, cached after)
at its CPU build's block size (128). `--vllm-eager` and `--vllm-block-size` run it
otherwise, and its name in the results says so ("vllm (eager, block 32)"). Threads: both
compute on cores 0..N-1 (N: --threads, default this process's torch threads), kvlab
serve with N torch threads (OMP_NUM_THREADS) and vLLM with VLLM_CPU_OMP_THREADS_BIND=0-(N-1),
as `kvlab bench --vllm-threads N` binds it (kvlab.peers.vllm_peer.VllmPeer): vLLM's own
"auto" binding computes on one core of two.

Needs vLLM's venv ($KVLAB_VLLM_VENV, else .venv-vllm in the checkout). Prints one row
per server and dataset: requests completed/failed, request throughput, output tok/s,
TTFT and ITL p50/p99 (ms) as vLLM's client measured them, the prefix-cache queries and
hits each server's /metrics counted (the same series names on both; hits count in whole
blocks, so the block sizes differ in what they can hit) and the block size each server's
`vllm:cache_config_info` reports. Each server runs in its own process group and is
stopped before the next starts. `--out` writes the JSON with its provenance block
(benchmarks/stamp.py).

--quick: the random dataset only, 2 prompts, vllm serve eager: still one start of each
server and one client run against each (a minute or two on 2 cores, most of it vLLM
starting). --model: a checkpoint directory instead of the embedded model (at least
MAX_MODEL_LEN positions, a head size vLLM's CPU attention takes: 32, 64, ...), served
by both under the embedded model's name.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from stamp import provenance  # noqa: E402

import kvlab  # noqa: E402
from kvlab.model.loading import EMBEDDED_MODEL, cache_dir  # noqa: E402
from kvlab.peers.vllm_peer import vllm_system_name  # noqa: E402
from kvlab.peers.vllm_serve import (  # noqa: E402
    bench_serve,
    server_process,
    vllm_cli_missing,
    vllm_env,
    vllm_serve_argv,
)
from kvlab.serve.server import free_socket  # noqa: E402

BUDGET_BYTES = 1 << 30  # 1 GiB of KV on both
MAX_MODEL_LEN = 2048
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


def cores(threads: int) -> str:
    """Cores 0..threads-1 as VLLM_CPU_OMP_THREADS_BIND reads them (VllmPeer's binding)."""
    return "0" if threads == 1 else f"0-{threads - 1}"


def kvlab_argv(port: int, model: str | None = None) -> list[str]:
    config = {
        "cache": "paged",
        "prefix_caching": "hash",
        "max_num_seqs": MAX_NUM_SEQS,
        "max_num_batched_tokens": MAX_BATCHED_TOKENS,
        "chunked_prefill": True,  # as vLLM schedules by default
    }  # its own block size (16)
    return [
        sys.executable, "-m", "kvlab", "serve", "--port", str(port), "--device", "cpu",
        "--config", json.dumps(config), "--budget", str(BUDGET_BYTES),
        "--max-model-len", str(MAX_MODEL_LEN), "--log-level", "warning",
    ] + (["--model", model, "--served-model-name", EMBEDDED_MODEL] if model else [])  # fmt: skip


def scrape(url: str) -> tuple[dict[str, float], dict[str, str]]:
    """The prefix-cache and preemption counters of a server's /metrics, and the labels of
    its vllm:cache_config_info (block_size, num_gpu_blocks, ...)."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions")
    values, info = {name: 0.0 for name in wanted}, {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        if family.name in wanted:
            values[family.name] += sum(s.value for s in family.samples if s.name.endswith("_total"))
        elif family.name == "vllm:cache_config_info" and family.samples:
            info = dict(family.samples[0].labels)
    return values, info


def run_server(name: str, argv: list[str], env, url: str, model_path: str, args, log_dir):
    rows = []
    started = time.perf_counter()
    with server_process(argv, url, log_dir / f"{name}_server.log", env=env, timeout_s=900):
        ready_s = time.perf_counter() - started
        for dataset in args.datasets.split(","):
            before, info = scrape(url)
            result = bench_serve(
                url, model=EMBEDDED_MODEL, tokenizer=model_path, dataset=dataset,
                num_prompts=args.num_prompts, seed=args.seed,
            )  # fmt: skip
            after, _ = scrape(url)
            row = {"server": name, "dataset": dataset, "ready_s": round(ready_s, 1)}
            row["block_size"] = int(info["block_size"]) if "block_size" in info else None
            row |= {k: result.get(k) for k in KEYS}
            row |= {k.split(":")[1]: after[k] - before[k] for k in after}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", default="kvlab,vllm")
    parser.add_argument("--quick", action="store_true", help="random, 2 prompts, vLLM eager")
    parser.add_argument("--model", default=None, help="a checkpoint directory (default: embedded)")
    parser.add_argument("--datasets", help="default random,prefix_repetition (--quick: random)")
    parser.add_argument("--num-prompts", type=int, help="default 8 (--quick: 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads", type=int, default=None,
        help="cores 0..N-1 for both servers (default: this process's torch threads)",
    )  # fmt: skip
    parser.add_argument(
        "--vllm-eager", action="store_true",
        help="vllm serve with --enforce-eager (named 'vllm (eager)' in the results)",
    )  # fmt: skip
    parser.add_argument(
        "--vllm-block-size", type=int, default=None,
        help="vllm serve's block size (default: its own, 128; a multiple of 32)",
    )  # fmt: skip
    parser.add_argument("--out", default=None, help="also write the JSON here")
    parser.add_argument("--log-dir", default=None, help="server logs (default: a temp dir)")
    args = parser.parse_args(argv)
    args.datasets = args.datasets or ("random" if args.quick else "random,prefix_repetition")
    args.num_prompts = args.num_prompts or (2 if args.quick else 8)
    args.vllm_eager = args.vllm_eager or args.quick
    given = sys.argv[1:] if argv is None else argv
    missing = vllm_cli_missing()
    if missing:
        raise SystemExit(f"vllm bench serve cannot run: {missing}")
    import torch

    if not args.model:
        kvlab.load_model(device="cpu", progress=False)  # converts the embedded model once
    threads = args.threads or torch.get_num_threads()
    model_path = str(
        Path(args.model).resolve() if args.model else cache_dir() / "models" / EMBEDDED_MODEL
    )
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvlab-serve-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"server logs: {log_dir}", file=sys.stderr)
    vllm_name = vllm_system_name(args.vllm_eager, args.vllm_block_size)
    servers = {
        "kvlab": {"block_size": "its own (16)", "chunked_prefill": True,
                  "threads": f"{threads} torch threads (OMP_NUM_THREADS={threads})"},
        vllm_name: {"compiled": not args.vllm_eager,
                    "block_size": args.vllm_block_size or "its own (128)",
                    "threads": f"VLLM_CPU_OMP_THREADS_BIND={cores(threads)}"},
    }  # fmt: skip
    rows = []
    for name in args.servers.split(","):
        sock = free_socket()
        port = sock.getsockname()[1]
        sock.close()
        url = f"http://127.0.0.1:{port}"
        if name == "kvlab":
            command = kvlab_argv(port, model_path if args.model else None)
            env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        elif name == "vllm":
            command = vllm_serve_argv(
                model_path, port, BUDGET_BYTES, MAX_MODEL_LEN, args.vllm_block_size,
                MAX_NUM_SEQS, MAX_BATCHED_TOKENS, served_model_name=EMBEDDED_MODEL,
                enforce_eager=args.vllm_eager,
            )  # fmt: skip
            env, name = vllm_env(VLLM_CPU_OMP_THREADS_BIND=cores(threads)), vllm_name
        else:
            raise SystemExit(f"--servers: {name!r} is not kvlab or vllm")
        rows += run_server(name, command, env, url, model_path, args, log_dir)
    report = {
        "provenance": provenance(
            "vLLM's own client (vllm bench serve, all prompts at once) against kvlab serve "
            f"and vllm serve, each at its defaults on the same {threads} core(s)",
            shlex.join(["python", "benchmarks/serve_vs_vllm.py", *given]), 1,
        ),
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}",
        "model": model_path if args.model else EMBEDDED_MODEL,
        "settings": {
            "kv_budget_bytes": BUDGET_BYTES, "max_model_len": MAX_MODEL_LEN,
            "max_num_seqs": MAX_NUM_SEQS, "max_num_batched_tokens": MAX_BATCHED_TOKENS,
            "num_prompts": args.num_prompts, "random": "64 -> 16 tokens",
            "prefix_repetition": "2 prefixes x 256 + 32 -> 16", "servers": servers,
        },
        "rows": rows,
    }  # fmt: skip
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return report


if __name__ == "__main__":
    main()
