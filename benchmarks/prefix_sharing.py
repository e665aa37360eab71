"""Issue figures for prefix sharing: 64 requests sharing the ~300-token preamble.

    python benchmarks/prefix_sharing.py [--requests 64]

Prints JSON: prompt tokens computed and peak physical KV blocks with vs without prefix
caching (hash and radix), time to first token of a warm request vs a cold one, and the
memory copy-on-write saves for n=4 sampling.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

import kvlab
from kvlab import texts

NEW_TOKENS = 8


def shared_prompts(n: int) -> list[str]:
    questions = texts.questions()
    return [f"{texts.preamble()}\n\nQuestion: {questions[i % len(questions)]}" for i in range(n)]


def serve(model, prompts, prefix_caching):
    engine = kvlab.Engine(
        model,
        kvlab.EngineConfig(
            cache="paged",
            prefix_caching=prefix_caching,
            max_model_len=2048,
            kv_budget_tokens=64 * 512,
        ),
    )
    params = kvlab.SamplingParams(NEW_TOKENS, ignore_eos=True)
    # The first request goes alone: blocks are shared once its prompt is computed (requests
    # prefilled in the very same step cannot reuse each other's blocks yet).
    outputs = engine.generate(prompts[:1], params) + engine.generate(prompts[1:], params)
    stats = engine.stats()
    queried = int(stats["prefix_query_tokens"].sum())
    return outputs, {
        "prompt_tokens": queried,
        "prompt_tokens_computed": queried - int(stats["prefix_hit_tokens"].sum()),
        "peak_blocks": int(stats["blocks_used"].max()),
    }


def ttft(model, prompts) -> dict:
    """One request alone (cold), then another with the same preamble (warm)."""
    engine = kvlab.Engine(model, kvlab.EngineConfig(cache="paged", prefix_caching="hash"))
    times = []
    for prompt in prompts[:2]:
        start = time.perf_counter()
        engine.generate([prompt], kvlab.SamplingParams(1))
        times.append(time.perf_counter() - start)
    return {
        "cold_s": round(times[0], 4),
        "warm_s": round(times[1], 4),
        "warm_over_cold": round(times[1] / times[0], 3),
    }


def cow(model, prompt) -> dict:
    """n=4 samples sharing the prompt vs four independent copies of it."""
    peaks = {}
    for name, (prompts, n) in {
        "copy_on_write": ([prompt], 4),
        "four_copies": ([prompt] * 4, 1),
    }.items():
        engine = kvlab.Engine(model, kvlab.EngineConfig(cache="paged", max_model_len=2048))
        params = kvlab.SamplingParams(32, n=n, temperature=0.8, seed=0, ignore_eos=True)
        engine.generate(prompts, params)
        peaks[name] = int(engine.stats()["blocks_used"].max())
    peaks["saved_frac"] = round(1 - peaks["copy_on_write"] / peaks["four_copies"], 3)
    return peaks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=64)
    args = parser.parse_args()
    model = kvlab.load_model()
    prompts = shared_prompts(args.requests)
    result = {
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, {model.device}",
        "workload": f"{args.requests} requests: preamble + question, {NEW_TOKENS} new tokens",
    }
    outputs = {}
    for name in (None, "hash", "radix"):
        outputs[name], result[f"prefix_caching={name}"] = serve(model, prompts, name)
    off = result["prefix_caching=None"]["prompt_tokens_computed"]
    for name in ("hash", "radix"):
        on = result[f"prefix_caching={name}"]
        on["computed_reduction"] = round(1 - on["prompt_tokens_computed"] / off, 4)
        on["identical_outputs"] = [o.token_ids for o in outputs[name]] == [
            o.token_ids for o in outputs[None]
        ]
    result["ttft"] = ttft(model, prompts)
    result["n4_sampling_peak_blocks"] = cow(model, prompts[0])
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
