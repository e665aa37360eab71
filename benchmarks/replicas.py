"""Many replicas: routing policies in front of 3 `kvlab serve` processes, on a multi-tenant,
multi-turn chat workload whose working set exceeds one replica's KV but fits three.

    .venv/bin/python benchmarks/replicas.py --rounds 5
    .venv/bin/python benchmarks/replicas.py --rounds 5 --vllm-router /tmp/vr/bin/vllm-router
    .venv/bin/python benchmarks/replicas.py --quick --model PATH --out /tmp/replicas.json

Replicas: `kvlab serve` processes (kvlab.route.replicas), the embedded model (or --model
PATH, a checkpoint directory), paged cache
with hash prefix caching and vLLM's sha256_cbor block hashes, `--budget` KV tokens each,
one thread each, publishing KV events over ZMQ. Routers: `kvlab route` as a process of
its own (policies round-robin, least-loaded, approx-prefix, precise; switched through
POST /router/policy), and, given `--vllm-router`, the vLLM Router (PyPI `vllm-router`, a
Rust gateway) with its `cache_aware` policy (a radix tree of what it routed) and its
`kv_aware` policy (the replicas' KV events), one process per run.

Workload: kvlab.route.sessions: `--sessions` chats of `--turns` turns over `--tenants`
tenants (vLLM's cache_salt per tenant), each turn the whole conversation, `--concurrency`
turns at once, greedy, `--max-tokens` answers. The client applies the chat template and
sends token ids to /v1/completions (as `kvlab replay` does): vllm-router 0.1.17's kv_aware
policy over HTTP hashes token-id prompts only (a chat request is "missing_tokens" to it,
and it falls back to load). The replicas serve the model under its local path's name,
where vllm-router reads the tokenizer.

Every run starts cold: each replica's prefix cache is reset (POST /reset_prefix_cache,
which its events report as AllBlocksCleared). Runs alternate policies round by round (the
order rotates), so load on this shared machine falls on all of them alike. Per run: the
prefix hit rate as the replicas count it (sum of vllm:prefix_cache_hits over
vllm:prefix_cache_queries), TTFT p50/p99 at the client, output tokens per second, requests
per replica and the imbalance (the busiest replica's requests over the mean; 1.0 is even),
and the load average. Per policy: median, min and max over rounds.

Writes benchmarks/results/replicas.<machine class>.json (or --out) with the provenance
block (benchmarks/stamp.py: machine, CPU flags, date, command, rounds). --quick: 2 replicas,
2 sessions of 2 turns over 2 tenants (600-character documents), 4-token answers, 1 round,
kvlab route's policies only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from stamp import machine_class, provenance  # noqa: E402

from kvlab.experiments.scripts import sized
from kvlab.model.loading import EMBEDDED_MODEL, cache_dir  # noqa: E402
from kvlab.route.replicas import ServeReplicas, free_port  # noqa: E402
from kvlab.route.sessions import run_chats, summary, tenant_sessions  # noqa: E402

KVLAB_POLICIES = ("round-robin", "least-loaded", "approx-prefix", "precise")
# The served model's name is its local path: vllm-router reads the tokenizer from there
MODEL_PATH = str(cache_dir() / "models" / EMBEDDED_MODEL)
# (full, --quick) sizes of the options that default to None
SIZES = {
    "replicas": (3, 2),
    "budget": ("3072tok", "2048tok"),
    "sessions": (12, 2),
    "turns": (3, 2),
    "tenants": (3, 2),
    "doc_chars": (2500, 600),
    "max_tokens": (32, 4),
    "concurrency": (3, 2),
    "rounds": (5, 1),
}
COUNTERS = {
    "vllm:prefix_cache_queries": "queries",
    "vllm:prefix_cache_hits": "hits",
    "vllm:request_success": "requests",
    "vllm:num_preemptions": "preemptions",
}


def counters(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    values = dict.fromkeys(COUNTERS.values(), 0.0)
    page = httpx.get(url + "/metrics", timeout=30).text
    for family in text_string_to_metric_families(page):
        if family.name in COUNTERS:
            total = sum(s.value for s in family.samples if s.name.endswith("_total"))
            values[COUNTERS[family.name]] += total
    return values


def wait_up(url: str, process: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url}: the router exited with {process.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not come up")


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def start_kvlab_route(replicas: ServeReplicas, log_dir: Path) -> tuple[str, subprocess.Popen]:
    port = free_port()
    argv = [sys.executable, "-m", "kvlab", "route", "--port", str(port), "--log-level", "warning"]
    for b in replicas.backends():
        argv += ["--backend", f"{b.url},events={b.events},replay={b.replay},name={b.name}"]
    log = open(log_dir / "kvlab_route.log", "w")
    process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_up(url, process)
    return url, process


def start_vllm_router(binary: str, policy: str, replicas: ServeReplicas, log_dir: Path, model):
    port = free_port()
    argv = [binary, "--port", str(port), "--policy", policy,
            "--worker-urls", *[r.url for r in replicas.replicas],
            "--prometheus-port", str(free_port()), "--worker-startup-check-interval", "1",
            "--log-level", "warning"]  # fmt: skip
    if policy == "kv_aware":
        argv += ["--kv-event-block-size", "16", "--kv-event-model", model]
        for r in replicas.replicas:
            argv += ["--kv-event-source", f"{r.url}=tcp://127.0.0.1:{r.events_port}"]
            argv += ["--kv-event-replay-source", f"{r.url}=tcp://127.0.0.1:{r.replay_port}"]
    log = open(log_dir / f"vllm_router_{policy}.log", "a")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                               start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    wait_up(url, process)
    return url, process


def cold(replicas: ServeReplicas, router_url: str | None) -> None:
    """Reset every replica's prefix cache; wait until kvlab route's index says so."""
    replicas.reset_prefix_caches()
    if router_url is None:
        return
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        state = httpx.get(router_url + "/router/state", timeout=10).json()
        if all(r["index_blocks"] == 0 for r in state["replicas"]):
            return
        time.sleep(0.2)
    raise RuntimeError("the router's index did not clear after the reset")


def one_run(name, url, replicas, sessions, args, kvlab_route_url, served, tokenizer) -> dict:
    """One policy's run from cold; the client sends token ids (the chat template applied)."""
    cold(replicas, kvlab_route_url)
    before = {r.name: counters(r.url) for r in replicas.replicas}
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    turns = run_chats(url, served, sessions, max_tokens=args.max_tokens,
                      concurrency=args.concurrency, tokenizer=tokenizer)  # fmt: skip
    wall = time.perf_counter() - started
    after = {r.name: counters(r.url) for r in replicas.replicas}
    delta = {n: {k: after[n][k] - before[n][k] for k in after[n]} for n in after}
    row = summary(turns, wall)
    queries = sum(d["queries"] for d in delta.values())
    hits = sum(d["hits"] for d in delta.values())
    per_replica = {n: int(d["requests"]) for n, d in delta.items()}
    mean = statistics.mean(per_replica.values())
    row.update({
        "policy": name,
        "prefix_hit_rate": round(hits / queries, 4) if queries else None,
        "replica_requests": per_replica,
        "imbalance": round(max(per_replica.values()) / mean, 3) if mean else None,
        "preemptions": int(sum(d["preemptions"] for d in delta.values())),
        "load_before": round(load_before, 2),
        "load_after": round(os.getloadavg()[0], 2),
    })  # fmt: skip
    return row


def aggregate(rows: list[dict]) -> dict:
    out = {}
    for policy in dict.fromkeys(r["policy"] for r in rows):
        mine = [r for r in rows if r["policy"] == policy]
        stats = {}
        for key in ("prefix_hit_rate", "ttft_p50_s", "ttft_p99_s", "tok_s", "imbalance"):
            values = [r[key] for r in mine if r[key] is not None]
            if values:
                stats[key] = {
                    "median": round(statistics.median(values), 4),
                    "min": round(min(values), 4),
                    "max": round(max(values), 4),
                }
        out[policy] = {"runs": len(mine), **stats}
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 replicas, 2 short chats, 1 round")
    parser.add_argument("--model", default=None, help="a checkpoint directory (default: embedded)")
    parser.add_argument("--replicas", type=int, help="default 3 (--quick: 2)")
    parser.add_argument("--budget", help="KV per replica: default 3072tok (--quick: 2048tok)")
    parser.add_argument("--sessions", type=int, help="default 12 (--quick: 2)")
    parser.add_argument("--turns", type=int, help="default 3 (--quick: 2)")
    parser.add_argument("--tenants", type=int, help="default 3 (--quick: 2)")
    parser.add_argument("--doc-chars", type=int, help="a document's length: 2500 (--quick: 600)")
    parser.add_argument("--max-tokens", type=int, help="default 32 (--quick: 4)")
    parser.add_argument("--concurrency", type=int, help="default 3 (--quick: 2)")
    parser.add_argument("--rounds", type=int, help="default 5 (--quick: 1)")
    parser.add_argument("--policies", default=",".join(KVLAB_POLICIES))
    parser.add_argument(
        "--vllm-router",
        default=None,
        help="the vllm-router binary (pip install vllm-router; default: on PATH, "
        "except with --quick); none: skip it",
    )
    parser.add_argument("--vllm-router-policies", default="cache_aware,kv_aware")
    parser.add_argument(
        "--out", default=None, help="default benchmarks/results/replicas.<class>.json"
    )
    args = parser.parse_args(argv)
    sized(args, SIZES)
    if args.vllm_router is None:
        args.vllm_router = "none" if args.quick else shutil.which("vllm-router")
    served = args.model or MODEL_PATH  # the served name; vllm-router reads its tokenizer
    policies = [p for p in args.policies.split(",") if p]
    if args.vllm_router and args.vllm_router != "none":
        policies += [f"vllm-router:{p}" for p in args.vllm_router_policies.split(",") if p]
    sessions = tenant_sessions(
        args.sessions, args.turns, args.tenants, max_doc_chars=args.doc_chars
    )
    from kvlab.route.server import load_tokenizer

    tokenizer = load_tokenizer(served)
    out = Path(args.out or Path(__file__).parent / "results" / f"replicas.{machine_class()}.json")
    log_dir = Path("/tmp/kvlab-replicas-bench")
    log_dir.mkdir(exist_ok=True)
    rows = []
    replicas = ServeReplicas(args.replicas, budget=args.budget, model=args.model, threads=1,
                             log_dir=str(log_dir),
                             extra_args=("--served-model-name", served))  # fmt: skip
    with replicas as reps:
        route_url, route = start_kvlab_route(reps, log_dir)
        try:
            for r in range(args.rounds):
                order = policies[r % len(policies) :] + policies[: r % len(policies)]
                for name in order:
                    if name.startswith("vllm-router:"):
                        url, process = start_vllm_router(args.vllm_router, name.split(":")[1],
                                                         reps, log_dir, served)  # fmt: skip
                        try:
                            row = one_run(
                                name, url, reps, sessions, args, route_url, served, tokenizer
                            )
                        finally:
                            stop(process)
                    else:
                        httpx.post(
                            route_url + "/router/policy", json={"policy": name}
                        ).raise_for_status()
                        httpx.post(route_url + "/router/reset").raise_for_status()
                        row = one_run(
                            name, route_url, reps, sessions, args, route_url, served, tokenizer
                        )
                    row["round"] = r
                    rows.append(row)
                    print(json.dumps({k: row[k] for k in ("round", "policy", "prefix_hit_rate",
                          "ttft_p50_s", "ttft_p99_s", "tok_s", "imbalance", "load_before")}),
                          flush=True)  # fmt: skip
        finally:
            stop(route)
    command = " ".join(["python benchmarks/replicas.py", *(sys.argv[1:] if argv is None else argv)])
    notes = (f"{args.replicas} kvlab serve replicas (1 thread each) on a 2-core machine shared "
             "with other work; load average recorded per run")  # fmt: skip
    report = {
        "provenance": provenance(
            "routing policies over kvlab serve replicas (many replicas)",
            command,
            args.rounds,
            notes,
        ),  # fmt: skip
        "settings": {
            k: getattr(args, k)
            for k in (
                "replicas",
                "budget",
                "sessions",
                "turns",
                "tenants",
                "doc_chars",
                "max_tokens",
                "concurrency",
            )
        },  # fmt: skip
        "vllm_router": args.vllm_router or "not installed",
        "summary": aggregate(rows),
        "runs": rows,
    }
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["summary"], indent=1))
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
