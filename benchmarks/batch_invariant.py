"""The cost of batch-invariant mode: tok/s with and without it, doc-QA and chat.

    python benchmarks/batch_invariant.py [--doc-qa 4] [--chat 16] [--rounds 5] [--out F]
    python benchmarks/batch_invariant.py --quick --model PATH   # 1 + 2 prompts, 1 round

`kvlab bench`'s runner (kvlab.experiments.bench.run_bench, no peers) serves each workload
with the paged cache and prefix caching, on the torch and the kernels attention, each
without and with EngineConfig(batch_invariant=True): four systems, their order reversed
every other round. Prints JSON: per workload and system, output tok/s of every round
(median, min, max, spread = (max - min) / median), the batch-invariant over default
ratio per attention (of the medians, and the median of the per-round ratios), whether
the greedy tokens agree, and the load average before and after. benchmarks/stamp.py adds
the machine's CPU, date and command to a saved run.
"""

from __future__ import annotations

import os
import statistics

from kvlab import workloads
from kvlab.experiments.bench import run_bench
from kvlab.experiments.scripts import load, machine, report, script_parser

ATTENTION = {"torch": "paged+prefix", "kernels": "paged+prefix+kernels"}


def summary(result) -> dict:
    """Per system: tok/s of each round and their median, min, max and spread; per
    attention: batch-invariant over default."""
    rates = {}
    for name, system in result.systems.items():
        rounds = [system.output_tokens / wall for wall in system.walls_s]
        median = statistics.median(rounds)
        rates[name.removeprefix("kvlab-")] = {
            "tok_s_rounds": [round(r, 2) for r in rounds],
            "tok_s_median": round(median, 2),
            "tok_s_min": round(min(rounds), 2),
            "tok_s_max": round(max(rounds), 2),
            "spread": round((max(rounds) - min(rounds)) / median, 3),
        }
    ratios = {}
    for attention, config in ATTENTION.items():
        on, off = rates[f"{config}+invariant"], rates[config]
        per_round = [a / b for a, b in zip(on["tok_s_rounds"], off["tok_s_rounds"])]
        ratios[attention] = {
            "of_medians": round(on["tok_s_median"] / off["tok_s_median"], 3),
            "median_of_rounds": round(statistics.median(per_round), 3),
            "rounds": [round(r, 3) for r in per_round],
        }
    agreement = {
        name.removeprefix("kvlab-"): share
        for name, share in result.meta.get("token_agreement", {}).items()
    }
    return {"systems": rates, "invariant_over_default": ratios, "token_agreement": agreement}


def main(argv: list[str] | None = None) -> dict:
    parser = script_parser(__doc__)
    parser.add_argument("--doc-qa", type=int, help="doc-QA requests: default 4 (--quick: 1)")
    parser.add_argument("--chat", type=int, help="chat requests: default 16 (--quick: 2)")
    parser.add_argument("--rounds", type=int, help="alternating rounds: default 5 (--quick: 1)")
    args = parser.parse_args(argv)
    model = load(args)
    quick, rounds = args.quick, args.rounds or (1 if args.quick else 5)
    answers = (2, 4) if quick else (8, 24)
    loads = {
        "doc-qa": workloads.doc_qa(args.doc_qa or (1 if quick else 4), 2387, answers, answers),
        "chat": workloads.chat(args.chat or (2 if quick else 16), 0, (4, 8) if quick else (16, 64)),
    }
    configs = [c for config in ATTENTION.values() for c in (config, f"{config}+invariant")]
    out = {
        "machine": machine(model),
        "model": model.name,
        "rounds": rounds,
        "load_average_before": [round(x, 2) for x in os.getloadavg()],
        "workloads": {},
    }
    for name, requests in loads.items():
        result = run_bench(model, requests, configs, peers=(), rounds=rounds, workload=name)
        out["workloads"][name] = summary(result)
    out["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    return report(out, args.out)


if __name__ == "__main__":
    main()
