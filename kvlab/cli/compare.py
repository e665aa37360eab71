"""`kvlab compare`: one workload through several KV-cache configs, same model and budget
(kvlab.experiments.compare); --html writes its figures (kvlab.viz.compare) as a report."""

from __future__ import annotations

import argparse

from kvlab.cache import CACHES
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
from kvlab.presets import DEFAULT_CONFIGS, options
from kvlab.units import MiB

HELP = "one workload through several KV-cache configs, same model and budget"


def add_arguments(cmp: argparse.ArgumentParser) -> None:
    workload_args(cmp, default="doc-qa")
    cmp.add_argument(
        "--stop-at-eos", action="store_true", help="stop at EOS (default: exact token counts)"
    )
    cmp.add_argument(
        "--configs",
        default=",".join(DEFAULT_CONFIGS),
        help=f"comma-separated config names: a cache ({' | '.join(CACHES.names())}), then "
        f"options: {', '.join('+' + o for o in options())}, +bsN (block size N)",
    )
    cmp.add_argument(
        "--budget",
        default=None,
        help="KV budget for every config: bytes (64MiB, 200MB) or tokens in the model's "
        "dtype (4096tok); default: four naive sequences",
    )
    cmp.add_argument("--block-size", type=int, default=16)
    cmp.add_argument("--max-num-seqs", type=int, default=64)
    cmp.add_argument("--html", default=None, metavar="PATH", help="write a plotly report")
    endpoint_args(cmp)


def run(args: argparse.Namespace) -> int:
    from kvlab.experiments.compare import compare

    requests = load_workload(args)
    configs = split(args.configs)
    model, budget = model_and_budget(args, configs)
    result = compare(
        model,
        requests,
        configs,
        budget_bytes=budget,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        ignore_eos=not args.stop_at_eos,
        progress=not args.quiet,
        workload=args.workload,
        max_num_seqs=args.max_num_seqs,
    )
    endpoint = replay_endpoint(args, model, requests)
    if args.html:
        write_html(args.html, result)
    if args.json:
        print_json(result.to_json(), endpoint)
    else:
        print(
            f"{args.workload}: {len(requests)} requests, KV budget "
            f"{result.budget_bytes / MiB:.1f} MiB, max_model_len {result.max_model_len}"
        )
        print(result.table().astype(object).T.to_string())
        print_endpoint(endpoint)
    return 0


def write_html(path: str, comparison) -> None:
    """A self-contained HTML report of a Comparison: the metrics table and every figure."""
    from kvlab.viz.compare import comparison_figures
    from kvlab.viz.report import write_report

    title = f"kvlab compare: {comparison.workload}"
    note = (
        f"KV budget {comparison.budget_bytes / MiB:.1f} MiB for every config, "
        f"max_model_len {comparison.max_model_len}."
    )
    tables = {"metrics": comparison.table()}
    write_report(path, title, note, tables, comparison_figures(comparison))
