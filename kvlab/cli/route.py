"""`kvlab route`: a cache-aware router, OpenAI-compatible, in front of N replicas
(kvlab.route)."""

from __future__ import annotations

import argparse

HELP = "a cache-aware router in front of N OpenAI-compatible replicas (KV events)"


def add_arguments(rt: argparse.ArgumentParser) -> None:
    rt.add_argument(
        "--backend",
        action="append",
        required=True,
        metavar="URL[,events=tcp://H:P][,replay=tcp://H:P][,topic=T][,name=N]",
        help="a replica (repeat the flag): its base URL and, for the precise policy, "
        "where it publishes KV events (kvlab serve / vllm serve --kv-events-config)",
    )
    rt.add_argument(
        "--policy",
        default="precise",
        help="round-robin, least-loaded, approx-prefix or precise (default)",
    )
    rt.add_argument(
        "--load-guard",
        type=int,
        default=2,
        help="prefix policies: replicas more than this many requests busier than the "
        "least busy one do not compete on prefix",
    )
    rt.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="precise: the replicas' block size (default: as their events say)",
    )
    rt.add_argument(
        "--hash-seed",
        default=None,
        help="precise: the replicas' NONE_HASH seed (vLLM's PYTHONHASHSEED; default "
        "'vllm-none-hash')",
    )
    rt.add_argument(
        "--tokenizer",
        default=None,
        help="the replicas' tokenizer, to hash chat and text prompts (default: the "
        "embedded model's; 'none': token-id prompts only)",
    )
    rt.add_argument("--host", default="127.0.0.1")
    rt.add_argument("--port", type=int, default=8080)
    rt.add_argument("--log-level", default="info", choices=["debug", "info", "warning"])


def run(args: argparse.Namespace) -> int:
    from kvlab.route.router import Backend, Router
    from kvlab.route.server import load_tokenizer, run_router

    backends = [Backend.parse(text, i) for i, text in enumerate(args.backend)]
    router = Router(
        backends,
        policy=args.policy,
        tokenizer=load_tokenizer(args.tokenizer),
        load_guard=args.load_guard,
        block_size=args.block_size,
        hash_seed=args.hash_seed,
    )
    run_router(router, args.host, args.port, args.log_level)
    return 0
