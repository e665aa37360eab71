"""Tensor parallelism as processes on this machine (kvlab.experiments.tensor_parallel).

    python benchmarks/tensor_parallel.py [--sizes 1 3 9]
    python benchmarks/tensor_parallel.py --quick --model PATH   # 2 prompts, seconds

Prints JSON per tensor_parallel_size: KV heads and KV bytes per token on each rank (per-rank
KV stops shrinking once tp exceeds the KV heads: they are replicated), all-reduces per
step, whether greedy tokens equal tp = 1, start-up time and decode tokens/s (the ranks
share this machine's cores: the figure shows the collectives' cost, not a GPU speed-up).
"""

from __future__ import annotations

from kvlab import texts
from kvlab.experiments import tensor_parallel
from kvlab.experiments.scripts import load, machine, report, script_parser


def main(argv: list[str] | None = None) -> dict:
    parser = script_parser(__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", help="default: every valid size")
    args = parser.parse_args(argv)
    model = load(args)
    sizes = args.sizes or tensor_parallel.valid_sizes(model)
    prompts = texts.chat_prompts()[: 2 if args.quick else 4]
    new_tokens = 4 if args.quick else 32
    rows = tensor_parallel.run_tp(model, prompts, sizes, new_tokens)
    return report(
        {
            "machine": machine(model),
            "model": model.name,
            "workload": f"{len(prompts)} chat prompts, {new_tokens} greedy tokens each",
            "heads": model.config.num_attention_heads,
            "kv_heads": model.config.num_key_value_heads,
            "tensor_parallel": {str(tp): row for tp, row in rows.items()},
        },
        args.out,
    )


if __name__ == "__main__":
    main()
