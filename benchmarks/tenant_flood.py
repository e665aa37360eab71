"""Tenant B's time to first token while tenant A floods `kvlab serve`, with and without
per-tenant limits (issue 37).

    python benchmarks/tenant_flood.py [--rounds 3] [--flooders 16] [--probes 6]
        [--out benchmarks/results/tenant_flood.json]
    python benchmarks/tenant_flood.py --quick --model PATH   # 1 round, 4 flooders, 2 probes

Serves the embedded model (or --model) in this process (a thread on a free loopback
port, API keys for tenants A and B, paged+prefix, max_num_seqs 8). In each round, A's
`--flooders` clients send a 96-token prompt for 16 tokens, again as soon as each answer
comes (on a 429 they wait 0.1 s); once the flood fills the engine, B sends `--probes`
short requests one after another and times each first token over HTTP (streamed).
Without limits, B queues behind A's whole flood; with `--tenant-max-running 2
--tenant-max-queued 8`, A holds at most 2 places in the engine and B is admitted at the
next step. The two settings alternate round by round (the machine's noise hits both); B's
p50 / p99 are over every probe of every round, with each round's median beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import torch

import kvlab
from kvlab.experiments.scripts import sized
from kvlab.serve import ServerThread, engine_config
from kvlab.serve.limits import ServeLimits
from kvlab.serve.probe import bearer, first_token_s, flood
from kvlab.serve.tenants import Tenants

TENANTS = Tenants((("sk-a", "A"), ("sk-b", "B")))
LIMITED = ServeLimits(tenant_max_running=2, tenant_max_queued=8)


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


async def one_round(url: str, flooders: int, probes: int, server) -> tuple[list[float], dict]:
    """B's first-token times under A's flood, and A's counts."""
    flood_body = {"prompt": list(range(1000, 1096)), "max_tokens": 16, "ignore_eos": True}
    stop = asyncio.Event()
    a = asyncio.ensure_future(flood(url, flood_body, "sk-a", flooders, stop))
    busy = server.loop.call(lambda e: len(e.scheduler.running) + len(e.scheduler.waiting))
    while busy.result(60) < 2 and not a.done():
        await asyncio.sleep(0.05)  # the flood reaches the engine
        busy = server.loop.call(lambda e: len(e.scheduler.running) + len(e.scheduler.waiting))
    await asyncio.sleep(1.0)  # and fills it (or A's own queue)
    times = []
    async with httpx.AsyncClient(timeout=600, headers=bearer("sk-b")) as http:
        for i in range(probes):
            body = {"prompt": [2000 + i, 5, 6, 7, 8], "max_tokens": 2, "ignore_eos": True}
            times.append(await first_token_s(http, url, body))
    stop.set()
    count = await a
    return times, vars(count)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 round, 4 flooders, 2 probes")
    parser.add_argument("--rounds", type=int, help="default 3 (--quick: 1)")
    parser.add_argument("--flooders", type=int, help="default 16 (--quick: 4)")
    parser.add_argument("--probes", type=int, help="default 6 (--quick: 2)")
    parser.add_argument("--model", default=None, help="default: the embedded model")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    sizes = {"rounds": (3, 1), "flooders": (16, 4), "probes": (6, 2)}
    sized(args, sizes)  # (full, --quick)

    model = kvlab.load_model(args.model, device="cpu", progress=False)
    config = engine_config("paged+prefix", max_model_len=512, kv_budget_tokens=4096, max_num_seqs=8)
    rows = []
    for round_ in range(args.rounds):
        for name, limits in (("no limits", ServeLimits()), ("limits", LIMITED)):
            engine = kvlab.Engine(model, config)
            with ServerThread(engine, tenants=TENANTS, limits=limits) as server:
                url = f"{server.url}/v1/completions"
                started = time.perf_counter()
                times, a = asyncio.run(one_round(url, args.flooders, args.probes, server))
                wall = time.perf_counter() - started
            row = {"round": round_, "setting": name, "b_ttft_s": [round(t, 4) for t in times]}
            row.update(a_sent=a["sent"], a_completed=a["completed"], a_429=a["refused"])
            row["wall_s"] = round(wall, 1)
            rows.append(row)
            median = round(statistics.median(times), 3)
            print(json.dumps({**row, "median": median}), file=sys.stderr, flush=True)
    summary = {}
    for name in ("no limits", "limits"):
        times = [t for r in rows if r["setting"] == name for t in r["b_ttft_s"]]
        summary[name] = {
            "b_ttft_p50_s": round(float(np.percentile(times, 50)), 3),
            "b_ttft_p99_s": round(float(np.percentile(times, 99)), 3),
            "round_medians_s": [
                round(statistics.median(r["b_ttft_s"]), 3) for r in rows if r["setting"] == name
            ],
            "a_completed": sum(r["a_completed"] for r in rows if r["setting"] == name),
            "a_429": sum(r["a_429"] for r in rows if r["setting"] == name),
        }
    result = {
        "what": "tenant B's TTFT (client side, streamed) while tenant A floods kvlab serve",
        "command": " ".join(
            ["python benchmarks/tenant_flood.py", *(sys.argv[1:] if argv is None else argv)]
        ),
        "date": datetime.date.today().isoformat(),
        "machine": f"{cpu_name()}, {platform.machine()}, {os.cpu_count()} cores, "
        f"{torch.get_num_threads()} torch threads, load average {os.getloadavg()[0]:.1f}",
        "model": model.name,
        "engine": "paged+prefix, max_num_seqs 8, max_model_len 512, 4,096 KV tokens",
        "flood": f"{args.flooders} clients of A, 96-token prompt, 16 tokens each",
        "probes": f"{args.probes} sequential requests of B per round, 5-token prompt",
        "limits": "tenant_max_running=2, tenant_max_queued=8",
        "summary": summary,
        "rounds": rows,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
