"""KV cache groups on the embedded model given Gemma 3's 5 sliding : 1 full pattern: the
KV tokens one budget holds, and what multi-turn chats hit when the budget is short.

    python benchmarks/hybrid_cache.py [--window 32] [--sessions 6] [--out F]
    python benchmarks/hybrid_cache.py --quick --model PATH   # the tiny model, seconds

Four measurements (kvlab.experiments.hybrid_cache), every system on the same KV bytes:
- held: 16 distinct long prompts at once; all-full against the pattern in KV cache
  groups (cache="hybrid"): how many run at once and the context they hold;
- chat: multi-turn chats served in rounds at several budgets; the later turns' hit
  rate for all-full, the groups with every dropped window block cached, and the groups
  with a retention interval;
- granularity: the same chats over one large budget at several block sizes (a hit is
  whole blocks: vLLM's block for a hybrid model is the least common multiple of its
  groups' block sizes).
Counts, not timings: the figures do not depend on the machine's speed.
"""

from __future__ import annotations

import pandas as pd

from kvlab.config import EngineConfig
from kvlab.experiments.hybrid_cache import chat_hits, kv_held
from kvlab.experiments.scripts import load, machine, report, script_parser, sized


def config(budget: int, pattern: str | None = None, interval: int | None = None,
           block_size: int = 16) -> EngineConfig:  # fmt: skip
    """All full (no pattern: the paged cache) or the pattern's KV cache groups."""
    return EngineConfig(
        cache="paged" if pattern is None else "hybrid", attention_pattern=pattern,
        prefix_cache_retention_interval=interval, block_size=block_size,
        kv_budget_tokens=budget, prefix_caching="hash",
    )  # fmt: skip


def systems(pattern: str, budget: int, interval: int) -> dict[str, EngineConfig]:
    """All full, the pattern's groups, and the groups with a retention interval."""
    return {
        "all full": config(budget),
        "groups": config(budget, pattern),
        f"groups, interval {interval}": config(budget, pattern, interval),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = script_parser(__doc__)
    parser.add_argument("--window", type=int, help="sliding window: default 32 (--quick 8)")
    parser.add_argument("--sessions", type=int, help="chats: default 6 (--quick 2)")
    parser.add_argument("--budgets", help="chat KV budgets in tokens: default 2048,4096,8192")
    parser.add_argument("--interval", type=int, help="retention interval: default 128 (--quick 16)")
    parser.add_argument("--prompt-tokens", type=int, help="held: default 512 (--quick 48)")
    args = parser.parse_args(argv)
    sizes = {"window": (32, 8), "sessions": (6, 2), "interval": (128, 16),
             "prompt_tokens": (512, 48), "budgets": ("2048,4096,8192", "256")}  # fmt: skip
    sized(args, sizes)
    model = load(args)
    pattern = f"window={args.window}*5,full"
    budgets = [int(b) for b in args.budgets.split(",")]
    doc_chars = 600 if args.quick else 2500  # distinct documents: 1 quick, 8 full
    turns, new = (2, 4) if args.quick else (3, 16)
    held_budget = 4 * args.prompt_tokens  # a quarter of the 16 prompts, all full
    held = kv_held(model, systems(pattern, held_budget, args.interval), args.prompt_tokens)

    def chats(configs: dict) -> pd.DataFrame:
        return chat_hits(model, configs, [args.sessions], turns, new, max_doc_chars=doc_chars)

    chat = [
        chats(systems(pattern, budget, args.interval)).assign(kv_budget_tokens=budget)
        for budget in budgets
    ]
    grain = [
        chats({"groups": config(max(*budgets, 4096), pattern, block_size=b)})
        .assign(block_size=b)
        for b in (16, 256, 1024)
    ]  # fmt: skip
    return report(
        {
            "machine": machine(model),
            "model": model.name,
            "pattern": pattern,
            "held": held.to_dict("records"),
            "held_budget_tokens": held_budget,
            "chat": pd.concat(chat).round(2).to_dict("records"),
            "granularity": pd.concat(grain).round(2).to_dict("records"),
        },
        args.out,
    )


if __name__ == "__main__":
    main()
