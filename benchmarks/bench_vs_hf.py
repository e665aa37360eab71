"""kvlab vs HF transformers (`generate` and `generate_batch`): a thin wrapper over `kvlab bench`.

    python benchmarks/bench_vs_hf.py [--prompts 16] [--new-tokens 64] [--rounds 2] [...]

Without --workload it runs uniform chat prompts (16 x 64 new tokens, greedy, equal
lengths), the case HF `generate`'s static batches handle best. Every other option goes to
`kvlab bench` (see `kvlab bench --help`), e.g. `--workload doc-qa --save bench.json`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from kvlab.cli import main
from kvlab.workloads import uniform_chat, write_jsonl

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, add_help=False)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args, rest = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as folder:
        if "--workload" not in rest:
            workload = Path(folder) / f"uniform_chat_{args.prompts}x{args.new_tokens}.jsonl"
            write_jsonl(uniform_chat(args.prompts, args.new_tokens), workload)
            rest = ["--workload", str(workload), *rest]
        sys.exit(main(["bench", "--rounds", str(args.rounds), *rest]))
