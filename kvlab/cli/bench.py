"""`kvlab bench`: kvlab against HF transformers and vLLM on one workload
(kvlab.experiments.bench); --html writes its figure (kvlab.viz.bench) as a report."""

from __future__ import annotations

import argparse
import shlex

from kvlab.cli.shared import (
    endpoint_args,
    load_workload,
    model_and_budget,
    print_endpoint,
    print_json,
    replay_endpoint,
    split,
    workload_args,
)

HELP = "kvlab against HF and vLLM on one workload"


def add_arguments(bench: argparse.ArgumentParser) -> None:
    workload_args(bench, default="doc-qa")
    bench.add_argument(
        "--peers",
        default="hf-generate,hf-generate-batch",
        help="comma-separated peers: hf-generate, hf-generate-batch, vllm (vLLM at its "
        "defaults: compiled, its block size), vllm-eager (enforce_eager, reported as "
        "'vllm (eager)'); the vLLM peers need `make peers`",
    )
    bench.add_argument(
        "--same-block-size",
        action="store_true",
        help="also run each kvlab config at vLLM's CPU block size (128), a second line",
    )
    bench.add_argument(
        "--vllm-threads",
        type=int,
        default=None,
        help="vLLM's OpenMP threads, bound to cores 0..N-1 (default: vLLM's own binding)",
    )
    bench.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16"],
        help="the model's dtype for every system (default: fp32 on CPU, bf16 on CUDA)",
    )
    bench.add_argument(
        "--configs",
        default="paged+prefix",
        help="kvlab config(s); one is reported as 'kvlab', several as 'kvlab-<config>'",
    )
    bench.add_argument(
        "--budget", default=None, help="KV budget (as for compare); default: the whole workload"
    )
    bench.add_argument(
        "--hf-batch-size",
        type=int,
        default=None,
        help="hf-generate static batch size (default: 16, or the largest padded batch that "
        "fits the budget)",
    )
    bench.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="timed rounds, alternating order, after an untimed warm-up pass (default: 5 "
        "with peers, 1 for kvlab alone)",
    )
    bench.add_argument("--save", default=None, metavar="PATH", help="save the full result JSON")
    bench.add_argument("--html", default=None, metavar="PATH", help="write a plotly report")
    endpoint_args(bench)


def command_line(args: argparse.Namespace) -> str:
    """The `kvlab bench` command that `args` spell (options away from their defaults)."""
    defaults = argparse.ArgumentParser()
    add_arguments(defaults)
    parts = ["kvlab", "bench"]
    for action in defaults._actions:
        if action.dest not in vars(args) or not action.option_strings:
            continue
        value = getattr(args, action.dest)
        if value == action.default:
            continue
        flag = action.option_strings[-1]
        parts += [flag] if isinstance(value, bool) else [flag, str(value)]
    return shlex.join(parts)


def run(args: argparse.Namespace) -> int:
    from kvlab.experiments.bench import PEERS, provenance, run_bench

    requests = load_workload(args)
    peers, configs = split(args.peers), split(args.configs)
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        raise ValueError(f"unknown peer(s) {unknown}; choose from {PEERS}")
    model, budget = model_and_budget(args, configs)
    result = run_bench(
        model,
        requests,
        configs,
        peers,
        budget_bytes=budget,
        max_model_len=args.max_model_len,
        hf_batch_size=args.hf_batch_size,
        rounds=args.rounds,
        progress=not args.quiet,
        workload=args.workload,
        vllm_threads=args.vllm_threads,
        same_block_size=args.same_block_size,
    )
    result.provenance = provenance(result, command_line(args))
    endpoint = replay_endpoint(args, model, requests)
    if endpoint:
        result.meta["endpoint"] = endpoint
    if args.save:
        result.save(args.save)
    if args.html:
        write_html(args.html, result)
    if args.json:
        print_json(result.to_json(), endpoint)
    else:
        rounds = result.meta["rounds"]
        print(
            f"{args.workload}: {len(requests)} requests, greedy, same prompts and lengths; "
            f"{rounds} alternating round(s) after an untimed warm-up pass"
        )
        print(result.table().to_string())
        best = result.ratios()
        for name, ratio in result.median_ratios().items():
            print(f"{name}: {ratio:.2f}x (median rounds), {best[name]:.2f}x (fastest rounds)")
        agreement = result.meta["token_agreement"]
        print(
            "requests token-identical to kvlab:",
            ", ".join(f"{k} {v}" for k, v in agreement.items()),
        )
        for name in result.systems:
            vllm = result.meta.get(name) if name.startswith("vllm") else None
            if vllm:
                how = f"compiled ({vllm['compilation_mode']})" if vllm["compiled"] else "eager"
                print(
                    f"{name} {vllm['version']}: {how}, block size {vllm['block_size']}, "
                    f"engine built in {vllm['load_s']} s (not timed), "
                    f"VLLM_CPU_OMP_THREADS_BIND={vllm['VLLM_CPU_OMP_THREADS_BIND']}, "
                    f"OpenMP on cores {vllm['omp_core_ids']}"
                )
        print("threads:", result.provenance["threads"])
        print_endpoint(endpoint)
    return 0


def write_html(path: str, result) -> None:
    """A self-contained HTML report of a BenchResult: its tables and its tok/s figure."""
    import pandas as pd

    from kvlab.viz.bench import bench_figure
    from kvlab.viz.report import write_report

    note = ", ".join(f"{k}: {v}" for k, v in result.meta.items() if not isinstance(v, dict))
    tables = {"systems": result.table(), "ratios": pd.Series(result.ratios()).to_frame("ratio")}
    title = f"kvlab bench: {result.workload}"
    write_report(path, title, note, tables, {"tok/s": bench_figure(result)})
