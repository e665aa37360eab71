"""Prefix sharing: requests that share the ~300-token preamble (kvlab.experiments.sharing).

    python benchmarks/prefix_sharing.py [--requests 64]
    python benchmarks/prefix_sharing.py --quick --model PATH   # 3 requests, seconds

Prints JSON: prompt tokens computed and peak physical KV blocks with and without prefix
caching (hash and radix; the first request is prefilled alone, the rest arrive while it
decodes), whether the outputs are identical, time to first token of a warm request vs a
cold one, and the KV blocks copy-on-write saves for n=4 sampling.
"""

from __future__ import annotations

from kvlab.config import SamplingParams
from kvlab.experiments import sharing
from kvlab.experiments.scripts import load, machine, report, script_parser

KEYS = {"prompt tokens": "prompt_tokens", "tokens computed": "prompt_tokens_computed",
        "peak blocks": "peak_blocks", "computed reduction": "computed_reduction",
        "identical outputs": "identical_outputs"}  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    parser = script_parser(__doc__)
    parser.add_argument("--requests", type=int, help="default 64 (--quick: 3)")
    args = parser.parse_args(argv)
    model = load(args)
    n = args.requests or (3 if args.quick else 64)
    new_tokens, sampled = (2, 4) if args.quick else (8, 32)
    prompts = sharing.preamble_prompts(n)
    result = {
        "machine": machine(model),
        "model": model.name,
        "workload": f"{n} requests: preamble + question, {new_tokens} new tokens",
    }
    rows = sharing.index_savings(model, prompts, ("hash", "radix"), max_new_tokens=new_tokens)
    for kind, row in rows.items():
        result[f"prefix_caching={kind}"] = {KEYS[k]: v for k, v in row.items() if k in KEYS}
    result["ttft"] = sharing.warm_vs_cold(model, prompts)

    params = SamplingParams(sampled, n=4, temperature=0.8, seed=0, ignore_eos=True)
    forks, _ = sharing.fork_vs_separate(model, prompts[0], params)
    fork, separate = forks.values()
    result["n4_sampling_peak_blocks"] = {
        "copy_on_write": fork["peak blocks"],
        "four_copies": separate["peak blocks"],
        "saved_frac": round(1 - fork["peak blocks"] / separate["peak blocks"], 3),
        "same_samples": fork["texts"] == separate["texts"],
    }
    return report(result, args.out)


if __name__ == "__main__":
    main()
