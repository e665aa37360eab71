"""Issue figures for the paged cache, measured on the doc-QA workload at one KV budget.

    python benchmarks/paged_vs_naive.py [--requests 32] [--equality-requests 6]

Prints JSON: KV waste and peak concurrent sequences for the naive cache (reserving the
model's max context, 8192) and the paged cache (block size 16) on the same workload and
budget; and whether greedy outputs are identical across naive, paged (block sizes 1, 16,
64) and HF `generate` on a subset.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

import kvlab
from kvlab import workloads
from kvlab.experiments.peers import hf_generate

BUDGET_TOKENS = 4 * 8192


def serve(model, requests, **config):
    engine = kvlab.Engine(model, kvlab.EngineConfig(kv_budget_tokens=BUDGET_TOKENS, **config))
    start = time.perf_counter()
    outputs = engine.run(requests, ignore_eos=True, progress=True)
    wall = time.perf_counter() - start
    stats = engine.stats()
    peak = stats.loc[stats["reserved_bytes"].idxmax()]
    return outputs, {
        "peak_concurrent": int(stats["running"].max()),
        "waste_frac_mean": round(stats["waste_bytes"].sum() / stats["reserved_bytes"].sum(), 4),
        "waste_frac_at_peak": round(peak["waste_bytes"] / peak["reserved_bytes"], 4),
        "steps": len(stats),
        "wall_s": round(wall, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--equality-requests", type=int, default=6)
    args = parser.parse_args()
    model = kvlab.load_model()
    requests = workloads.doc_qa(args.requests, seed=0)

    result = {
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, {model.device}",
        "workload": f"doc_qa({args.requests}, seed=0), ignore_eos",
        "budget_tokens": BUDGET_TOKENS,
        "caches": {},
    }
    outputs = {}
    for name, config in {
        "naive": dict(cache="naive"),
        "paged16": dict(cache="paged", block_size=16),
    }.items():
        outputs[name], result["caches"][name] = serve(model, requests, **config)
    caches = result["caches"]
    result["peak_ratio_paged_over_naive"] = round(
        caches["paged16"]["peak_concurrent"] / caches["naive"]["peak_concurrent"], 2
    )
    result["identical_naive_paged16"] = [o.token_ids for o in outputs["naive"]] == [
        o.token_ids for o in outputs["paged16"]
    ]

    subset = [workloads.Request(r.prompt, 16) for r in requests[: args.equality_requests]]
    tokens = {}
    for name, config in {
        "naive": dict(cache="naive"),
        "paged1": dict(cache="paged", block_size=1),
        "paged16": dict(cache="paged", block_size=16),
        "paged64": dict(cache="paged", block_size=64),
    }.items():
        outs, _ = serve(model, subset, **config)
        tokens[name] = [o.token_ids for o in outs]
    prompt_ids = [o.prompt_token_ids for o in outs]
    hf = [hf_generate(model, [p], [16], batch_size=1).outputs[0] for p in prompt_ids]
    tokens["hf-generate"] = hf
    result["equality_subset"] = {
        "requests": len(subset),
        "new_tokens_each": 16,
        "identical_to_naive": {k: v == tokens["naive"] for k, v in tokens.items()},
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
