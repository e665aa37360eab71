"""KV tiers: a multi-turn chat trace >= 3x the device pool, device-only vs host / disk tiers.

The measurements are kvlab.experiments.tiers's.

    python benchmarks/kv_tiers.py                        # embedded model, 10 sessions x 3 turns
    python benchmarks/kv_tiers.py --configs "device only,host"   # a subset
    python benchmarks/kv_tiers.py --quick --model PATH   # 6 sessions x 2 turns, seconds

Prints JSON: per configuration the prompt tokens recomputed and their reduction against
device-only caching, whether every turn's greedy tokens are identical, blocks and bytes
moved per tier, measured seconds per block copy; the working set over the pool; the median
TTFT of a follow-up turn whose history is on the device, in host memory, on disk or
nowhere; copy times per block measured here, and a labelled what-if projection for a link
bandwidth (--link-gb-s), which is arithmetic, not a measurement.
"""

from __future__ import annotations

from kvlab import texts
from kvlab.experiments import tiers
from kvlab.experiments.scripts import load, machine, report, script_parser
from kvlab.multiturn import chat_sessions


def main(argv: list[str] | None = None) -> dict:
    parser = script_parser(__doc__)
    parser.add_argument("--sessions", type=int, help="default 10 (--quick: 6)")
    parser.add_argument("--turns", type=int, help="default 3 (--quick: 2)")
    parser.add_argument("--pool-tokens", type=int, help="device pool (default 1024; --quick 352)")
    parser.add_argument("--configs", help="comma-separated names (default: all)")
    what_if = "what-if link bandwidth in GB/s (default 25, ~PCIe 4.0 x16)"
    parser.add_argument("--link-gb-s", type=float, default=25.0, help=what_if)
    args = parser.parse_args(argv)
    model = load(args)
    n = args.sessions or (6 if args.quick else 10)
    turns = args.turns or (2 if args.quick else 3)
    pool = args.pool_tokens or (352 if args.quick else 1024)
    new_tokens = 4 if args.quick else 16
    sessions = chat_sessions(n, turns, max_doc_chars=1200 if args.quick else 2500)
    configs = tiers.tier_configs(pool // 16)
    if args.configs:
        wanted = [c.strip() for c in args.configs.split(",")]
        unknown = [c for c in wanted if c not in configs]
        if unknown:
            parser.error(f"--configs: unknown {unknown}; choose from {list(configs)}")
        configs = {c: configs[c] for c in ["device only", *wanted] if c in configs}
    max_len = 1024 if args.quick else 2048
    trace = tiers.compare_tiering(model, sessions, pool, max_new_tokens=new_tokens,
                                  configs=configs, max_model_len=max_len)  # fmt: skip
    trace.pop("frames")
    questions = texts.questions()[: 2 if args.quick else 5]
    copy = tiers.copy_times(model, repeats=5 if args.quick else 20)
    result = {
        "machine": machine(model),
        "model": model.name,
        "workload": f"{n} chat sessions x {turns} turns, {new_tokens} new tokens a turn, "
        f"2 turns at once, device pool {pool} tokens (block 16)",
        "trace": trace,
        "ttft_by_tier": tiers.ttft_by_tier(model, sessions[0], questions),
        "copy_per_block": copy,
        "what_if_projection": {
            "label": "a projection from --link-gb-s, not a measurement",
            "link_gb_s": args.link_gb_s,
            "block_bytes": copy["block_bytes"],
            "seconds_per_block": tiers.project_copy(copy["block_bytes"], args.link_gb_s),
        },
    }
    return report(result, args.out)


if __name__ == "__main__":
    main()
