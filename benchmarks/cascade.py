"""Cascade attention against the decode kernel alone, for bf16 decodes sharing a prefix.

    python benchmarks/cascade.py [--threads 2] [--out FILE]
    python benchmarks/cascade.py --quick   # small shapes, seconds

Prints JSON (kvlab.checks.cpu_kernels.cascade_rows): for B = 8, 16, 32 and 64 sequences
of SmolLM2-135M's attention shape whose first P positions are the same blocks (P = 304,
doc-QA's preamble; 640; 896; 2,048) and whose own parts are 1 to 300 positions more, one
layer's decode attention through the decode kernel (a chunk that up to 16 sequences share
read once for them) and through cascade attention (kernels/cpu_cascade.py: the prefix once
for all of them, on AMX tiles), alternated, best of 5, the largest difference between the
two outputs, and whether `cascade_pays` takes cascade attention there (the rule these rows
are the measurements behind). It needs a CPU with AMX-BF16; elsewhere it says so and
measures nothing.
"""

from __future__ import annotations

import os

import torch

from kvlab.checks import cpu_kernels
from kvlab.experiments.scripts import report, script_parser

PREFIXES, QUICK_PREFIXES = [304, 640, 896, 2048], [256]
BATCHES = (8, 16, 32, 64)


def main(argv: list[str] | None = None) -> dict:
    from kvlab.kernels.cpu_prefill import amx_ready

    args = script_parser(__doc__).parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = {"machine": f"{os.uname().machine}, {torch.get_num_threads()} torch threads"}
    if not amx_ready():
        result["skipped"] = "cascade attention needs a CPU with AMX-BF16"
    elif args.quick:
        result["cascade"] = cpu_kernels.cascade_rows(QUICK_PREFIXES, batches=(8,), own=20, rounds=2)
    else:
        result["cascade"] = cpu_kernels.cascade_rows(PREFIXES, BATCHES, **cpu_kernels.SMOLLM2)
    return report(result, args.out)


if __name__ == "__main__":
    main()
