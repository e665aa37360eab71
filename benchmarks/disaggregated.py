"""Colocated vs disaggregated prefill/decode under long-prompt interference
(kvlab.experiments.disagg).

    python benchmarks/disaggregated.py [--chat 8 --long 3]
    python benchmarks/disaggregated.py --quick --model PATH   # seconds

Prints JSON per setup (colocated, colocated + chunked prefill, disaggregated as two
processes): time to first token and inter-token latency p50/p99, tokens/s, KV bytes moved,
and whether the greedy tokens equal the colocated run. Both processes share this
machine's cores: the prefill process competes with the decodes for them.
"""

from __future__ import annotations

from kvlab.experiments import disagg
from kvlab.experiments.scripts import load, machine, report, script_parser


def main(argv: list[str] | None = None) -> dict:
    parser = script_parser(__doc__)
    parser.add_argument("--chat", type=int, help="chat requests decoding (default 6)")
    parser.add_argument("--long", type=int, help="long doc-QA prompts arriving (default 3)")
    args = parser.parse_args(argv)
    model = load(args)
    n_chat = args.chat or (2 if args.quick else 6)
    n_long = args.long or (1 if args.quick else 3)
    chat_tokens = 8 if args.quick else 64
    quick = args.quick
    trace = disagg.interference_trace(
        n_chat, n_long, chat_tokens, 4, 0.2 if quick else 1.0, 1500 if quick else None
    )
    return report(
        {
            "machine": machine(model) + " (prefill and decode processes share it)",
            "model": model.name,
            "workload": f"{n_chat} chat requests x {chat_tokens} tokens, {n_long} doc-QA "
            "prompts arriving among them",
            "setups": disagg.colocated_vs_disaggregated(model, trace),
        },
        args.out,
    )


if __name__ == "__main__":
    main()
