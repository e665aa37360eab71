"""The native CPU attention kernels against torch, on SmolLM2-135M's attention shapes.

    python benchmarks/cpu_kernels.py [--threads 2]
    python benchmarks/cpu_kernels.py --quick   # small shapes, seconds

Prints JSON (kvlab.checks.cpu_kernels):
  prompt       for each (cached P, new Q) of a doc-QA-like step: one layer's prompt
               attention in fp32 through the C prompt kernel and through the torch
               reference (causal scaled_dot_product_attention, or its masked call after a
               prefix), ms and GFLOP/s, alternated, best of 5, and the largest difference;
  prompt_bf16  the same in bf16: the AMX kernel where the CPU has AMX-BF16 ("kernel":
               "amx"), else the register tiles on widened values ("tiles"); and the
               tiles' time either way (tiles_ms);
  decode       one decode kernel call (32 sequences of 1,115 tokens) alone and right after
               a matmul, on torch's OpenMP threads (this process) and on the library's own
               pthreads (a child process with KVLAB_CPU_THREADS=own), fp32;
  decode_bf16  the first of those in bf16.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from kvlab.checks import cpu_kernels
from kvlab.experiments.scripts import report, script_parser

CASES = [(0, 1650), (0, 400), (300, 800), (900, 40), (1000, 20)]  # (cached, new)
QUICK_CASES = [(0, 40), (60, 8)]
CHILD = "import json, sys; from kvlab.checks import cpu_kernels as c; " \
        "print(json.dumps(c.decode_after_matmul(**json.loads(sys.argv[1]))))"  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    parser = script_parser(__doc__)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = cpu_kernels.SMOLLM2
    decode_args = {"batch": 4, "context": 100, "rounds": 3} if args.quick else {}
    decode_args |= shape
    threads = str(torch.get_num_threads())
    env = {**os.environ, "KVLAB_CPU_THREADS": "own", "OMP_NUM_THREADS": threads}
    child = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(decode_args)],
        env=env, capture_output=True, text=True, check=True, timeout=600,
    )  # fmt: skip
    cases, rounds = (QUICK_CASES, 2) if args.quick else (CASES, 5)
    result = {
        "machine": f"{os.uname().machine}, {torch.get_num_threads()} torch threads",
        "prompt": cpu_kernels.prompt_rows(cases, rounds=rounds, **shape),
        "prompt_bf16": cpu_kernels.prompt_rows(cases, rounds=rounds, dtype=torch.bfloat16, **shape),
        "decode": [cpu_kernels.decode_after_matmul(**decode_args), json.loads(child.stdout)],
        "decode_bf16": cpu_kernels.decode_after_matmul(**decode_args, dtype="bfloat16"),
    }
    return report(result, args.out)


if __name__ == "__main__":
    main()
