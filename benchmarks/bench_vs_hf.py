"""kvlab vs HF transformers (`generate` and `generate_batch`): a thin wrapper over `kvlab bench`.

    python benchmarks/bench_vs_hf.py [--prompts 16] [--new-tokens 64] [--rounds 2] [...]
    python benchmarks/bench_vs_hf.py --quick --model PATH   # 2 prompts x 4 tokens, seconds

Without --workload it runs uniform chat prompts (16 x 64 new tokens, greedy, equal
lengths), the case HF `generate`'s static batches handle best. Every other option goes to
`kvlab bench` (see `kvlab bench --help`), e.g. `--workload doc-qa --save bench.json`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from kvlab import cli
from kvlab.workloads import uniform_chat, write_jsonl


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a tiny workload, no progress bars")
    parser.add_argument("--prompts", type=int, help="uniform chat prompts: default 16 (--quick: 2)")
    parser.add_argument("--new-tokens", type=int, help="per prompt: default 64 (--quick: 4)")
    parser.add_argument("--rounds", type=int, help="alternating rounds: default 2 (--quick: 1)")
    args, rest = parser.parse_known_args(argv)
    n = args.prompts or (2 if args.quick else 16)
    new_tokens = args.new_tokens or (4 if args.quick else 64)
    rounds = args.rounds or (1 if args.quick else 2)
    if args.quick:
        rest = [*rest, "--quiet"]
    with tempfile.TemporaryDirectory() as folder:
        if "--workload" not in rest:
            workload = Path(folder) / f"uniform_chat_{n}x{new_tokens}.jsonl"
            write_jsonl(uniform_chat(n, new_tokens), workload)
            rest = ["--workload", str(workload), *rest]
        return cli.main(["bench", "--rounds", str(rounds), *rest])


if __name__ == "__main__":
    sys.exit(main())
