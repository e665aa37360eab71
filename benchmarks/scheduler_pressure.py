"""The scheduler under pressure (kvlab.experiments.stress): oversubscription, static vs
continuous batching, chunked prefill.

    python benchmarks/scheduler_pressure.py [--rounds 2]
    python benchmarks/scheduler_pressure.py --quick --model PATH   # short requests, seconds

Prints JSON: (1) a burst whose total KV demand is 4x the budget, per preemption mode:
requests completed, errors, preemptions, swapped bytes, recomputed tokens, whether the
outputs equal an unpressured run's and the budget is free at the end; (2) static vs
continuous batching throughput on mixed output lengths (best of --rounds, alternating);
(3) time per output token of running decodes while a long prompt arrives, with and
without chunked prefill.
"""

from __future__ import annotations

from kvlab import texts
from kvlab.config import EngineConfig
from kvlab.experiments import stress
from kvlab.experiments.scripts import load, machine, report, script_parser

# burst: requests (x burst_tokens) of the 4x oversubscription; batch: requests whose
# max_new_tokens cycle through `lengths`; the long prompt is the preamble + `documents`
# (~1,900 tokens; the preamble alone, ~315, with --quick), prefilled in chunks of `chunk`
# tokens while four streams decode `stream_tokens` each.
FULL = dict(
    burst=16,
    burst_tokens=32,
    batch=16,
    lengths=[96, 8],
    documents=[texts.documents()["doc16_history_of_maps"]],
    chunk=256,
    stream_tokens=48,
)
QUICK = dict(
    burst=8, burst_tokens=16, batch=6, lengths=[8, 2], documents=[], chunk=64, stream_tokens=8
)


def oversubscribed(model, n: int, new_tokens: int) -> dict:
    """A burst of n requests served with a quarter of the KV it needs, per preemption mode."""
    requests = stress.burst(n, new_tokens)
    calm, expected = stress.serve_burst(model, requests)
    demand = stress.kv_demand(calm, requests)
    budget = stress.oversubscribed_budget(demand, factor=4, block_size=16)
    result: dict = {"total_demand_tokens": demand, "budget_tokens": budget}
    for mode in ("recompute", "swap"):
        engine, outputs = stress.serve_burst(model, requests, budget, preemption=mode)
        summary = stress.burst_summary(engine, outputs)
        summary["identical_to_unpressured"] = [o.token_ids for o in outputs] == [
            o.token_ids for o in expected
        ]
        summary["budget_free_at_end"] = summary["blocks_held_at_end"] == 0
        result[mode] = summary
    return result


def static_vs_continuous(model, n: int, lengths: list[int], rounds: int) -> dict:
    """Output tokens per second, static vs continuous batching, best of `rounds`."""
    requests = stress.alternating(stress.burst(n), lengths)
    result: dict = {}
    for _ in range(rounds):  # alternating order; each mode's fastest round is kept
        for mode in ("static", "continuous"):
            _, run = stress.serve_batching(model, requests, mode, max_num_seqs=4)
            result[mode] = max(result.get(mode, 0.0), round(run["tokens_per_s"], 2))
    result["ratio_continuous_over_static"] = round(result["continuous"] / result["static"], 3)
    return result


def chunked_prefill(model, long_prompt: str, chunk: int, stream_tokens: int) -> dict:
    """The decode streams' time per output token while `long_prompt` arrives."""
    base = dict(cache="paged", max_model_len=min(4096, model.config.max_position_embeddings))
    configs = {
        "without": EngineConfig(**base, max_num_batched_tokens=4096),
        "with": EngineConfig(
            **base,
            chunked_prefill=True,
            schedule_order="decode-first",
            max_num_batched_tokens=chunk,
        ),
    }
    streams = texts.chat_prompts()[:4]
    result = {}
    for name, config in configs.items():
        engine = stress.long_prompt_arrives(model, config, streams, long_prompt, stream_tokens)
        result[name] = stress.gap_percentiles(stress.decode_gaps(engine.stats()))
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = script_parser(__doc__)
    parser.add_argument("--rounds", type=int, help="static vs continuous: default 2 (--quick: 1)")
    args = parser.parse_args(argv)
    model = load(args)
    size = QUICK if args.quick else FULL
    long_prompt = "\n\n".join([texts.preamble(), *size["documents"]])
    return report(
        {
            "machine": machine(model),
            "model": model.name,
            "oversubscription_4x": oversubscribed(model, size["burst"], size["burst_tokens"]),
            "static_vs_continuous": static_vs_continuous(
                model, size["batch"], size["lengths"], args.rounds or (1 if args.quick else 2)
            ),
            "chunked_prefill_decode_tpot": chunked_prefill(
                model, long_prompt, size["chunk"], size["stream_tokens"]
            ),
        },
        args.out,
    )


if __name__ == "__main__":
    main()
