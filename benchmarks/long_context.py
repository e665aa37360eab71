"""Long context on a budget: retention policies' recall, perplexity and KV memory
(kvlab.experiments.longctx, kvlab.cache.retention).

    python benchmarks/long_context.py [--lengths 1000 2000 4000] [--depths 0.1 0.5 0.9]
                                      [--ppl-tokens 2048] [--window 256]
    python benchmarks/long_context.py --quick --model PATH   # tiny sizes, seconds

Prints JSON:
- needle recall of full retention (the model's own long-context recall, the baseline),
  per haystack length;
- recall of window, sinks and h2o at 10 / 25 / 50 % of each haystack's KV, with the
  fraction of the full KV each actually held at peak (same needle set for all);
- perplexity of the held-out text teacher-forced with each policy at one budget
  (`--window` tokens), its increase over full retention, and the KV held at the end
  (flat in the context length for every policy but full).
Prompts run chunked (`--chunk` tokens per step), so a policy acts while the prompt
streams in and the cache never holds more than its budget plus one chunk.
"""

from __future__ import annotations

from kvlab.build import Engine
from kvlab.config import EngineConfig
from kvlab.experiments import longctx, quality
from kvlab.experiments.scripts import load, machine, report, script_parser
from kvlab.units import MiB


def main(argv: list[str] | None = None) -> dict:
    parser = script_parser(__doc__)
    parser.add_argument("--lengths", type=int, nargs="+", help="haystack tokens")
    parser.add_argument("--depths", type=float, nargs="+", help="needle depths in [0, 1]")
    parser.add_argument("--ppl-tokens", type=int, help="held-out tokens scored")
    parser.add_argument("--window", type=int, help="the perplexity runs' KV budget in tokens")
    parser.add_argument("--chunk", type=int, default=64, help="prefill chunk (tokens)")
    args = parser.parse_args(argv)
    model = load(args)
    lengths = args.lengths or ([200] if args.quick else [1000, 2000, 4000])
    depths = args.depths or ([0.5] if args.quick else [0.1, 0.5, 0.9])
    ppl_tokens = args.ppl_tokens or (160 if args.quick else 2048)
    window = args.window or (32 if args.quick else 256)
    longest = max(lengths) + 128  # fact, question and chat template
    base = EngineConfig(
        cache="paged",
        chunked_prefill=True,
        max_num_batched_tokens=args.chunk,
        max_num_seqs=1,
        max_model_len=longest,
        kv_budget_tokens=longest,
    )
    needles = longctx.needle_set(model.tokenizer, lengths, depths)
    frontier = longctx.recall_frontier(model, needles, base)
    full = frontier[frontier["policy"] == "full"]
    result = {
        "machine": machine(model),
        "model": model.name,
        "needles": f"{len(needles)}: haystacks of {lengths} tokens, depths {depths}",
        "full_recall_by_length": full.groupby("context_tokens")["recalled"].mean().to_dict(),
        "full_recall": float(full["recalled"].mean()),
        "recall": {},
    }
    budgets = frontier[frontier["policy"] != "full"]
    for (policy, budget), rows in budgets.groupby(["policy", "budget"], sort=False):
        result["recall"][f"{policy}@{budget:.0%}"] = {
            "recall": round(float(rows["recalled"].mean()), 3),
            "kv_kept_frac": round(float(rows["kv_kept_frac"].mean()), 3),
        }

    runner = Engine(model, EngineConfig(cache="paged")).runner
    ids = quality.heldout_ids(model, ppl_tokens)
    configs = {"full": base}
    configs |= {p: longctx.budget_config(base, p, window) for p in longctx.POLICIES}
    table, _ = longctx.perplexity_table(runner, ids, configs, chunk=args.chunk)
    result["perplexity"] = {
        "text": f"{len(ids)} held-out tokens, budget {window} tokens, chunks of {args.chunk}",
        **{
            row.policy: {
                "ppl": round(row.ppl, 3),
                "vs_full_pct": round(row.ppl_vs_full_pct, 2),
                "final_kv_mib": round(row.final_kv_bytes / MiB, 2),
            }
            for row in table.itertuples()
        },
    }
    return report(result, args.out)


if __name__ == "__main__":
    main()
