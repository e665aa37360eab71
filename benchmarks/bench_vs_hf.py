"""kvlab (naive cache) vs HF transformers `generate`: same model, prompts, greedy, one run.

    python benchmarks/bench_vs_hf.py [--prompts 16] [--new-tokens 64] [--rounds 2]

Systems run in alternating order, `rounds` times each; the best round of each is reported
(this machine is shared: the best round is the least disturbed one).
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

import kvlab
from kvlab import texts
from kvlab.peers import hf_generate


def run_kvlab(model, prompts, new_tokens):
    engine = kvlab.Engine(model, kvlab.EngineConfig(max_model_len=1024, kv_budget_tokens=16384))
    params = kvlab.SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    wall = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outputs), wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    model = kvlab.load_model()
    prompts = texts.chat_prompts()[: args.prompts]
    engine = kvlab.Engine(model, kvlab.EngineConfig(max_model_len=1024, kv_budget_tokens=1024))
    prompt_ids = [engine.encode(p) for p in prompts]
    best = {"kvlab-naive": 0.0, "hf-generate": 0.0}
    for _ in range(args.rounds):
        tokens, wall = run_kvlab(model, prompts, args.new_tokens)
        best["kvlab-naive"] = max(best["kvlab-naive"], tokens / wall)
        peer = hf_generate(model, prompt_ids, [args.new_tokens] * len(prompts), len(prompts))
        best["hf-generate"] = max(best["hf-generate"], peer.tok_s)
    result = {
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads, {model.device}",
        "workload": f"{args.prompts} chat prompts x {args.new_tokens} new tokens, greedy",
        "tok_s": {name: round(v, 1) for name, v in best.items()},
        "ratio_kvlab_over_hf": round(best["kvlab-naive"] / best["hf-generate"], 3),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
