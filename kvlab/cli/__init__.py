"""The `kvlab` command line (also `python -m kvlab`).

Each command is a module of this package: its HELP line, `add_arguments(parser)` (its
options) and `run(args) -> int`; `main` assembles them into one parser.

    generate.py   text for one or more prompts
    compare.py    one workload through several KV-cache configs (--html: a report)
    bench.py      kvlab against HF transformers and vLLM (--html: a report)
    profile.py    where a step's time goes, beside the decode floor (and vLLM's)
    plan.py       the capacity planner
    serve.py      the OpenAI-compatible server
    replay.py     a workload against any OpenAI-compatible server
    route.py      a cache-aware router in front of N replicas (KV events)
    workload.py   a built-in workload as a JSONL file
    shared.py     the options and helpers several commands share
"""

from __future__ import annotations

import argparse
import sys

from kvlab.cli import bench, compare, generate, plan, profile, replay, route, serve, workload

# name -> module, in the order `kvlab --help` lists them
COMMANDS = {
    "generate": generate,
    "compare": compare,
    "bench": bench,
    "profile": profile,
    "plan": plan,
    "serve": serve,
    "replay": replay,
    "route": route,
    "workload": workload,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvlab", description="The `kvlab` command line (also `python -m kvlab`)."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for name, command in COMMANDS.items():
        sub = commands.add_parser(name, help=command.HELP)
        command.add_arguments(sub)
        sub.set_defaults(run=command.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except ValueError as err:
        print(f"kvlab: error: {err}", file=sys.stderr)
        return 2
