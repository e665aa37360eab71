"""vLLM as the oracle of kvlab's accounting: prints both sides of every oracle run.

    python benchmarks/vllm_oracle.py [--save benchmarks/results/vllm_oracle.json]
    python benchmarks/vllm_oracle.py --quick --model PATH --save /tmp/vllm_oracle.json

Needs `make peers` (.venv-vllm). Same model, token ids, block size 32 and KV bytes, fp32,
greedy (kvlab.checks.vllm_oracle; tests/test_vllm_oracle.py asserts the same runs).
Prints the KV capacity for each byte budget, per request the prefix-hit tokens of kvlab
and vLLM (RequestOutput.num_cached_tokens) and whether their tokens are identical, and the
tight-budget run's peak running requests and preemptions. --quick runs the tight budget
alone (kvlab.checks.vllm_oracle.QUICK_RUNS: one vLLM engine; on a tiny model 15-20 s on
2 cores, most of it starting vLLM); --model is a local checkpoint directory whose head
size vLLM's CPU attention takes (32, 64, 80, ...).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import kvlab
from kvlab.checks.vllm_oracle import QUICK_RUNS, RUNS, run_oracle


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tight budget's run alone")
    parser.add_argument("--model", default=None, help="a checkpoint directory (default: embedded)")
    parser.add_argument("--save", default=None, metavar="PATH", help="also write JSON here")
    args = parser.parse_args(argv)
    model = kvlab.load_model(args.model, device="cpu", progress=False)
    report = run_oracle(model, QUICK_RUNS if args.quick else RUNS)
    capacity, requests, pressure = report.capacity(), report.requests(), report.pressure()
    print("KV capacity for a byte budget (block size 32, fp32):")
    print(capacity.to_string(), "\n")
    print("per request: prefix-hit tokens, tokens identical:")
    print(requests.to_string(index=False), "\n")
    _, answers = report.kvlab["pressure", "together"]
    print(f"tight budget, {len(answers)} chat answers of {len(answers[0].token_ids)} tokens:")
    print(pressure.to_string())
    data = {
        "model": model.name,
        "vllm_version": report.vllm["tight"].vllm_version,
        "capacity": capacity.to_dict(orient="index"),
        "requests": requests.to_dict(orient="records"),
        "pressure": pressure.to_dict(),
    }
    data = json.loads(json.dumps(data, default=lambda v: v.item()))  # numpy -> Python
    if args.save:
        Path(args.save).write_text(json.dumps(data, indent=2) + "\n")
    return data


if __name__ == "__main__":
    main()
