"""`kvlab plan`: the capacity planner (kvlab.planner): how many sequences fit."""

from __future__ import annotations

import argparse
import json

from kvlab.planner import WEIGHT_DTYPES, kv_formats

HELP = "capacity planner: how many sequences fit"


def add_arguments(plan: argparse.ArgumentParser) -> None:
    plan.add_argument(
        "--model",
        default="Llama-3-8B",
        help="a shipped config (SmolLM2-135M, Llama-3-8B, Mistral-7B, Qwen2.5-7B, "
        "Llama-3-70B) or a path to a HF config.json",
    )
    plan.add_argument("--memory", default="80GiB", help="accelerator memory, e.g. 80GiB, 24GB")
    plan.add_argument("--weight-dtype", default="bf16", choices=list(WEIGHT_DTYPES))
    plan.add_argument(
        "--kv-codec", default=None, choices=list(kv_formats()), help="default: weights' dtype"
    )
    plan.add_argument("--context", type=int, default=4096, help="tokens per sequence")
    plan.add_argument("--block-size", type=int, default=16)
    plan.add_argument("--users", type=int, default=None, help="concurrent sequences to check")
    plan.add_argument("--max-model-len", type=int, default=None)
    plan.add_argument("--utilization", type=float, default=0.9)
    plan.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="devices the model is split over, each with --memory (sizes are per device)",
    )
    plan.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    from kvlab.planner import ModelShape, gqa_vs_mha, plan

    shape = ModelShape.from_config(args.model)
    options = dict(
        memory=args.memory,
        weight_dtype=args.weight_dtype,
        kv_codec=args.kv_codec,
        context_len=args.context,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        utilization=args.utilization,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    result = plan(shape, users=args.users, **options)
    mha = plan(shape.with_mha(), users=args.users, **options)
    if args.json:
        print(json.dumps({"plan": result.to_dict(), "mha": mha.to_dict()}, indent=2))
    else:
        print(result.summary())
        print("\nGQA vs MHA (the same model with one KV head per query head):")
        print(gqa_vs_mha(shape, **options).to_string())
    return 0
