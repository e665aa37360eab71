"""The paged cache against the naive one, at one KV budget (kvlab.experiments.compare).

    python benchmarks/paged_vs_naive.py [--requests 32] [--equality-requests 6]
    python benchmarks/paged_vs_naive.py --quick --model PATH   # 6 chat requests, seconds

Prints JSON: KV waste and peak concurrent sequences for the naive cache (reserving the
model's max context, 8192 for the embedded model) and the paged cache (block size 16) on
the doc-QA workload and a budget of four max-context sequences; and whether greedy outputs
are identical across naive, paged (block sizes 1, 16, 64) and HF `generate` on a subset.
"""

from __future__ import annotations

from kvlab import workloads
from kvlab.experiments.compare import compare
from kvlab.experiments.scripts import load, machine, report, script_parser
from kvlab.peers.hf import hf_generate
from kvlab.presets import model_bytes_per_token

CACHES = {"naive": "naive", "paged16": "paged+bs16"}  # JSON name -> compare config
EQUALITY = {
    "naive": "naive",
    "paged1": "paged+bs1",
    "paged16": "paged+bs16",
    "paged64": "paged+bs64",
}


def main(argv: list[str] | None = None) -> dict:
    parser = script_parser(__doc__)
    parser.add_argument("--requests", type=int, help="default 32 (--quick: 6)")
    parser.add_argument("--equality-requests", type=int, help="default 6 (--quick: 2)")
    args = parser.parse_args(argv)
    model = load(args)
    n = args.requests or (6 if args.quick else 32)
    n_equal = args.equality_requests or (2 if args.quick else 6)
    new_tokens = 4 if args.quick else 16  # per request of the equality subset
    if args.quick:
        requests, workload = workloads.chat(n, max_new_tokens=(4, 12)), f"chat({n}, seed=0)"
    else:
        requests, workload = workloads.doc_qa(n), f"doc_qa({n}, seed=0)"
    max_len = model.config.max_position_embeddings  # what the naive cache reserves
    budget_tokens = 4 * max_len
    options = dict(budget_bytes=budget_tokens * model_bytes_per_token(model), max_model_len=max_len)

    runs = compare(model, requests, list(CACHES.values()), progress=not args.quick, **options)
    caches = {}
    for name, config in CACHES.items():
        run = runs.runs[config]
        caches[name] = {
            "peak_concurrent": run.metrics["peak_concurrent"],
            "waste_frac_mean": run.metrics["waste_frac"],
            "waste_frac_at_peak": run.metrics["waste_frac_at_peak"],
            "steps": len(run.stats),
            "wall_s": run.metrics["wall_s"],
        }
    outputs = {name: runs.runs[config].outputs for name, config in CACHES.items()}

    subset = [workloads.Request(r.prompt, new_tokens) for r in requests[:n_equal]]
    same = compare(model, subset, list(EQUALITY.values()), **options)
    tokens = {name: same.runs[config].outputs for name, config in EQUALITY.items()}
    prompts = workloads.encode_requests(model, subset)
    ids = [r.prompt for r in prompts]
    tokens["hf-generate"] = hf_generate(model, ids, [new_tokens] * len(ids), batch_size=1).outputs

    return report(
        {
            "machine": machine(model),
            "model": model.name,
            "workload": f"{workload}, ignore_eos",
            "budget_tokens": budget_tokens,
            "caches": caches,
            "peak_ratio_paged_over_naive": round(
                caches["paged16"]["peak_concurrent"] / caches["naive"]["peak_concurrent"], 2
            ),
            "identical_naive_paged16": outputs["naive"] == outputs["paged16"],
            "equality_subset": {
                "requests": len(subset),
                "new_tokens_each": new_tokens,
                "identical_to_naive": {k: v == tokens["naive"] for k, v in tokens.items()},
            },
        },
        args.out,
    )


if __name__ == "__main__":
    main()
