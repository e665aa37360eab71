"""What several commands share: the workload and endpoint options, config names, the
model with its KV budget, and an endpoint's replayed row."""

from __future__ import annotations

import argparse
import json


def workload_args(sub: argparse.ArgumentParser, default: str) -> None:
    sub.add_argument(
        "--workload",
        default=default,
        help="a built-in workload (doc-qa, chat, uniform-chat) or a .jsonl file",
    )
    sub.add_argument("--n", type=int, default=None, help="requests (built-in workloads)")
    sub.add_argument("--seed", type=int, default=None, help="seed (built-in workloads)")
    sub.add_argument("--max-model-len", type=int, default=None)
    sub.add_argument("--model", default=None, help="HF hub id or local dir (default: embedded)")
    sub.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    sub.add_argument("--json", action="store_true", help="print one JSON object")
    sub.add_argument("--quiet", action="store_true", help="no progress bars")


def load_workload(args: argparse.Namespace):
    """The requests of --workload (a built-in name, with --n and --seed, or a .jsonl file)."""
    from kvlab.workloads import load_workload

    options = {k: v for k, v in (("n", args.n), ("seed", args.seed)) if v is not None}
    try:
        return load_workload(args.workload, **options)
    except TypeError as err:
        raise ValueError(f"workload {args.workload!r}: {err}") from None


def endpoint_args(sub: argparse.ArgumentParser) -> None:
    sub.add_argument(
        "--endpoint",
        default=None,
        metavar="URL",
        help="also replay the workload (same token ids) against this OpenAI-compatible "
        "server (kvlab serve, vllm serve) and read its /metrics",
    )
    sub.add_argument(
        "--endpoint-model", default=None, help="the model name it serves (default: its first)"
    )


def replay(args: argparse.Namespace, endpoint: str, model, requests):
    """A ReplayResult (kvlab.serve.replay) of the workload against one endpoint."""
    from kvlab.serve.replay import replay_workload

    ignore_eos = not getattr(args, "stop_at_eos", False)
    return replay_workload(endpoint, model, requests, args.endpoint_model, ignore_eos)


def replay_endpoint(args: argparse.Namespace, model, requests) -> dict | None:
    """The endpoint's summary row, or None without --endpoint."""
    return replay(args, args.endpoint, model, requests).summary() if args.endpoint else None


def print_json(out: dict, endpoint: dict | None) -> None:
    """A command's JSON object, with the endpoint's row (--endpoint) under "endpoint"."""
    print(json.dumps({**out, "endpoint": endpoint} if endpoint else out, indent=2))


def print_endpoint(row: dict | None) -> None:
    if row:
        print(f"\nendpoint {row['endpoint']} (its /metrics; latencies on this client's clock):")
        print("\n".join(f"  {key}: {value}" for key, value in row.items() if key != "endpoint"))


def split(names: str) -> list[str]:
    """Comma-separated names, blanks dropped: 'a, b,,c' -> ['a', 'b', 'c']."""
    return [n.strip() for n in names.split(",") if n.strip()]


def model_and_budget(args: argparse.Namespace, configs: list[str]):
    """Check the config names (a bad one fails before the model loads), then load the
    model and read --budget (None: the command's default)."""
    import torch

    import kvlab
    from kvlab.presets import model_bytes_per_token, parse_budget, parse_config

    for name in configs:
        parse_config(name)
    dtype = getattr(torch, args.dtype) if getattr(args, "dtype", None) else None
    model = kvlab.load_model(args.model, device=args.device, dtype=dtype, progress=not args.quiet)
    budget = parse_budget(args.budget, model_bytes_per_token(model)) if args.budget else None
    return model, budget
