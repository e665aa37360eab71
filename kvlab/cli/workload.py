"""`kvlab workload`: a built-in workload (kvlab.workloads) written as a JSONL file."""

from __future__ import annotations

import argparse

from kvlab.cli.shared import load_workload

HELP = "write a built-in workload as a JSONL file"


def add_arguments(wl: argparse.ArgumentParser) -> None:
    wl.add_argument("name", help="a built-in workload name")
    wl.add_argument("--n", type=int, default=None, help="number of requests")
    wl.add_argument("--seed", type=int, default=None)
    wl.add_argument("--out", required=True, metavar="PATH", help="the .jsonl file to write")


def run(args: argparse.Namespace) -> int:
    from kvlab.workloads import WORKLOADS, write_jsonl

    if args.name not in WORKLOADS:
        raise ValueError(f"unknown workload {args.name!r}: give one of {list(WORKLOADS)}")
    args.workload = args.name
    requests = load_workload(args)
    write_jsonl(requests, args.out)
    print(f"wrote {len(requests)} requests to {args.out}")
    return 0
