"""`kvlab generate`: text for one or more prompts from one engine."""

from __future__ import annotations

import argparse
import json

from kvlab.cache import CACHES
from kvlab.config import EngineConfig, SamplingParams

HELP = "generate text for one or more prompts"


def add_arguments(gen: argparse.ArgumentParser) -> None:
    gen.add_argument("prompts", nargs="+", help="prompt text (one argument per prompt)")
    gen.add_argument("--model", default=None, help="HF hub id or local dir (default: embedded)")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    gen.add_argument("--cache", default="naive", choices=CACHES.names())
    gen.add_argument("--max-model-len", type=int, default=None)
    gen.add_argument("--kv-budget-tokens", type=int, default=None)
    gen.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    gen.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    import kvlab

    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    config = EngineConfig(
        cache=args.cache, max_model_len=args.max_model_len, kv_budget_tokens=args.kv_budget_tokens
    )
    model = kvlab.load_model(args.model, device=args.device, progress=not args.json)
    engine = kvlab.Engine(model, config)
    outputs = engine.generate(args.prompts, params, chat=not args.no_chat)
    if args.json:
        rows = [
            {
                "prompt": prompt,
                "text": out.text,
                "token_ids": out.token_ids,
                "finish_reason": out.finish_reason,
                "ttft_s": out.metrics.ttft_s,
                "tpot_s": out.metrics.tpot_s,
            }
            for prompt, out in zip(args.prompts, outputs)
        ]
        print(json.dumps({"model": model.name, "outputs": rows}, indent=2))
    else:
        for prompt, out in zip(args.prompts, outputs):
            print(f">>> {prompt}\n{out.text}\n")
    return 0
