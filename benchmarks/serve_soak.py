"""Issue figures for the soak of `kvlab serve` (issues 15 and 37): concurrent streaming
clients of two tenants on loopback with random disconnects and bad requests mixed in.

    python benchmarks/serve_soak.py [--clients 64] [--requests-per-client 2] [--prompts 16]
    python benchmarks/serve_soak.py --quick --model PATH   # 8 clients, 4 prompts, 4 tokens: seconds

Serves the embedded model (or --model) in this process on a free loopback port, with API
keys for two tenants (clients alternate between them) and a KV budget too small for
every client at once (watermark admission: requests preempt), and prints JSON: clients,
requests, completed, matched a solo run, disconnects, bad requests answered 4xx,
unexpected failures, leaked blocks, crashes (1 if the engine loop died), the tenant
audit of the block tables (hits checked, cross-tenant hits and shares), preemptions, and
whether the server was still up; `--out` also writes it to a file.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

import kvlab
from kvlab import texts
from kvlab.experiments.scripts import sized
from kvlab.serve import ServerThread, engine_config
from kvlab.serve.audit import TenantAudit
from kvlab.serve.soak import settle, soak
from kvlab.serve.tenants import Tenants

TENANTS = Tenants((("sk-alice", "alice"), ("sk-bob", "bob")))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 clients, 4 prompts, 4 tokens")
    parser.add_argument("--clients", type=int, help="default 64 (--quick: 8)")
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, help="default 8 (--quick: 4)")
    parser.add_argument(
        "--prompts", type=int, help="distinct chat prompts: default 16 (--quick: 4)"
    )
    parser.add_argument("--budget-tokens", type=int, default=768)
    parser.add_argument("--model", default=None, help="default: the embedded model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    sizes = {"clients": (64, 8), "max_tokens": (8, 4), "prompts": (16, 4)}
    sized(args, sizes)  # (full, --quick)

    model = kvlab.load_model(args.model, device="cpu", progress=False)
    max_model_len = 1024
    solo = kvlab.Engine(model, engine_config("paged", max_model_len=max_model_len))
    chats = texts.chat_prompts()[: args.prompts]
    prompts = [solo.encode(p) for p in chats]  # chat template applied
    params = kvlab.SamplingParams(max_new_tokens=args.max_tokens, ignore_eos=True)
    expected = [solo.generate([p], params)[0].text for p in prompts]  # one at a time
    print(f"{len(prompts)} solo runs done", file=sys.stderr, flush=True)

    config = engine_config(
        "paged+prefix+watermark", max_model_len=max_model_len, kv_budget_tokens=args.budget_tokens
    )
    engine = kvlab.Engine(model, config)
    audit = TenantAudit().install(engine)
    started = time.perf_counter()
    with ServerThread(engine, tenants=TENANTS) as server:
        report = asyncio.run(
            soak(server.url, model.name, prompts, expected, max_model_len=max_model_len,
                 max_tokens=args.max_tokens, clients=args.clients,
                 requests_per_client=args.requests_per_client, seed=args.seed,
                 keys=["sk-alice", "sk-bob"])
        )  # fmt: skip
        wall_s = time.perf_counter() - started
        settle(server, report, audit)
        preemptions = server.loop.call(lambda e: e.scheduler.preemptions).result(60)
    command = sys.argv[1:] if argv is None else argv
    result = {
        "command": " ".join(["python benchmarks/serve_soak.py", *command]),
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, cpu",
        "load_average": round(os.getloadavg()[0], 1),
        "tenants": 2,
        "model": model.name,
        "config": "paged+prefix+watermark",
        "budget_tokens": args.budget_tokens,
        "max_tokens": args.max_tokens,
        "distinct_prompts": len(prompts),
        **report.as_dict(),
        "preemptions": preemptions,
        "ok": report.ok(),
        "wall_s": round(wall_s, 1),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
