"""The `kvlab` command line (also `python -m kvlab`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from kvlab.cache import CACHES
from kvlab.config import EngineConfig, SamplingParams
from kvlab.experiments.configs import DEFAULT_CONFIGS, options
from kvlab.planner import WEIGHT_DTYPES, kv_formats
from kvlab.units import MiB


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvlab", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="generate text for one or more prompts")
    gen.add_argument("prompts", nargs="+", help="prompt text (one argument per prompt)")
    gen.add_argument("--model", default=None, help="HF hub id or local dir (default: embedded)")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    gen.add_argument("--cache", default="naive", choices=CACHES.names())
    gen.add_argument("--max-model-len", type=int, default=None)
    gen.add_argument("--kv-budget-tokens", type=int, default=None)
    gen.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    gen.set_defaults(run=run_generate)

    cmp = commands.add_parser(
        "compare", help="one workload through several KV-cache configs, same model and budget"
    )
    _workload_args(cmp, default="doc-qa")
    cmp.add_argument(
        "--stop-at-eos", action="store_true", help="stop at EOS (default: exact token counts)"
    )
    cmp.add_argument(
        "--configs",
        default=",".join(DEFAULT_CONFIGS),
        help=f"comma-separated config names: a cache ({' | '.join(CACHES.names())}), then "
        f"options: {', '.join('+' + o for o in options())}, +bsN (block size N)",
    )
    cmp.add_argument(
        "--budget",
        default=None,
        help="KV budget for every config: bytes (64MiB, 200MB) or tokens in the model's "
        "dtype (4096tok); default: four naive sequences",
    )
    cmp.add_argument("--block-size", type=int, default=16)
    cmp.add_argument("--max-num-seqs", type=int, default=64)
    cmp.add_argument("--html", default=None, metavar="PATH", help="write a plotly report")
    _endpoint_args(cmp)
    cmp.set_defaults(run=run_compare)

    bench = commands.add_parser("bench", help="kvlab against HF and vLLM on one workload")
    _workload_args(bench, default="doc-qa")
    bench.add_argument(
        "--peers",
        default="hf-generate,hf-generate-batch",
        help="comma-separated peers: hf-generate, hf-generate-batch, vllm (needs `make peers`)",
    )
    bench.add_argument(
        "--vllm-threads",
        type=int,
        default=None,
        help="vLLM's OpenMP threads, bound to cores 0..N-1 (default: vLLM's own binding)",
    )
    bench.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16"],
        help="the model's dtype for every system (default: fp32 on CPU, bf16 on CUDA)",
    )
    bench.add_argument(
        "--configs",
        default="paged+prefix",
        help="kvlab config(s); one is reported as 'kvlab', several as 'kvlab-<config>'",
    )
    bench.add_argument(
        "--budget", default=None, help="KV budget (as for compare); default: the whole workload"
    )
    bench.add_argument(
        "--hf-batch-size",
        type=int,
        default=None,
        help="hf-generate static batch size (default: 16, or the largest padded batch that "
        "fits the budget)",
    )
    bench.add_argument("--rounds", type=int, default=1, help="alternating-order rounds")
    bench.add_argument("--save", default=None, metavar="PATH", help="save the full result JSON")
    bench.add_argument("--html", default=None, metavar="PATH", help="write a plotly report")
    _endpoint_args(bench)
    bench.set_defaults(run=run_bench)

    prof = commands.add_parser(
        "profile", help="where kvlab's step time goes, part by part, beside the decode floor"
    )
    _workload_args(prof, default="uniform-chat")
    prof.add_argument("--config", default="paged+prefix", help="one kvlab config name")
    prof.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    prof.add_argument("--budget", default=None, help="KV budget; default: the whole workload")
    prof.add_argument("--save", default=None, metavar="PATH", help="save steps + floor as JSON")
    prof.add_argument(
        "--peer",
        default=None,
        choices=["vllm"],
        help="also profile vLLM on the same tokens and threads (needs `make peers`)",
    )
    prof.set_defaults(run=run_profile)

    plan = commands.add_parser("plan", help="capacity planner: how many sequences fit")
    plan.add_argument(
        "--model",
        default="Llama-3-8B",
        help="a shipped config (SmolLM2-135M, Llama-3-8B, Mistral-7B, Qwen2.5-7B, "
        "Llama-3-70B) or a path to a HF config.json",
    )
    plan.add_argument("--memory", default="80GiB", help="accelerator memory, e.g. 80GiB, 24GB")
    plan.add_argument("--weight-dtype", default="bf16", choices=list(WEIGHT_DTYPES))
    plan.add_argument(
        "--kv-codec", default=None, choices=list(kv_formats()), help="default: weights' dtype"
    )
    plan.add_argument("--context", type=int, default=4096, help="tokens per sequence")
    plan.add_argument("--block-size", type=int, default=16)
    plan.add_argument("--users", type=int, default=None, help="concurrent sequences to check")
    plan.add_argument("--max-model-len", type=int, default=None)
    plan.add_argument("--utilization", type=float, default=0.9)
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.set_defaults(run=run_plan)

    srv = commands.add_parser(
        "serve", help="an OpenAI-compatible HTTP server with vLLM's /metrics over one engine"
    )
    srv.add_argument("--model", default=None, help="HF hub id or local dir (default: embedded)")
    srv.add_argument(
        "--config",
        default=None,
        help="a config name (as for compare; default paged+prefix) or a JSON object of "
        'EngineConfig fields, e.g. \'{"cache": "paged", "admission": "watermark"}\'',
    )
    srv.add_argument("--budget", default=None, help="KV budget: bytes (1GiB) or tokens (8192tok)")
    srv.add_argument("--max-model-len", type=int, default=None)
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--served-model-name", default=None, help="default: the model's name")
    srv.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    srv.add_argument("--log-level", default="info", choices=["debug", "info", "warning"])
    srv.add_argument("--api-key", default=None, help="require this Bearer key (vLLM's flag)")
    srv.add_argument(
        "--api-keys-file",
        default=None,
        metavar="PATH",
        help='a JSON object {"key": "tenant", ...}: each tenant its own prefix cache',
    )
    srv.add_argument("--max-request-bytes", type=int, default=1 << 20, help="413 past it")
    srv.add_argument(
        "--tenant-max-running", type=int, default=None, help="a tenant's requests in the engine"
    )
    srv.add_argument(
        "--tenant-max-queued", type=int, default=None, help="a tenant's waiting ones (429 past)"
    )
    srv.set_defaults(run=run_serve)

    rep = commands.add_parser(
        "replay", help="a workload against any OpenAI-compatible server, with its /metrics"
    )
    rep.add_argument(
        "--endpoint",
        required=True,
        metavar="URL[,URL...]",
        help="e.g. http://host:8000; several (comma-separated) run one after another",
    )
    rep.add_argument(
        "--endpoint-model", default=None, help="the model name it serves (default: its first)"
    )
    rep.add_argument(
        "--tokenizer",
        default=None,
        help="local tokenizer dir or hub id of the served model (default: the embedded model)",
    )
    rep.add_argument("--workload", default="doc-qa", help="a built-in workload or a .jsonl file")
    rep.add_argument("--n", type=int, default=None, help="requests (built-in workloads)")
    rep.add_argument("--seed", type=int, default=None, help="seed (built-in workloads)")
    rep.add_argument("--stop-at-eos", action="store_true", help="default: exact token counts")
    rep.add_argument("--json", action="store_true", help="print a JSON list, a row per server")
    rep.add_argument("--html", default=None, metavar="PATH", help="write a plotly report")
    rep.set_defaults(run=run_replay)

    wl = commands.add_parser("workload", help="write a built-in workload as a JSONL file")
    wl.add_argument("name", help="a built-in workload name")
    wl.add_argument("--n", type=int, default=None, help="number of requests")
    wl.add_argument("--seed", type=int, default=None)
    wl.add_argument("--out", required=True, metavar="PATH", help="the .jsonl file to write")
    wl.set_defaults(run=run_workload)
    return parser


def _workload_args(sub: argparse.ArgumentParser, default: str) -> None:
    sub.add_argument(
        "--workload",
        default=default,
        help="a built-in workload (doc-qa, chat, uniform-chat) or a .jsonl file",
    )
    sub.add_argument("--n", type=int, default=None, help="requests (built-in workloads)")
    sub.add_argument("--seed", type=int, default=None, help="seed (built-in workloads)")
    sub.add_argument("--max-model-len", type=int, default=None)
    sub.add_argument("--model", default=None, help="HF hub id or local dir (default: embedded)")
    sub.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    sub.add_argument("--json", action="store_true", help="print one JSON object")
    sub.add_argument("--quiet", action="store_true", help="no progress bars")


def _load_workload(args: argparse.Namespace):
    from kvlab.workloads import load_workload

    options = {k: v for k, v in (("n", args.n), ("seed", args.seed)) if v is not None}
    try:
        return load_workload(args.workload, **options)
    except TypeError as err:
        raise ValueError(f"workload {args.workload!r}: {err}") from None


def _endpoint_args(sub: argparse.ArgumentParser) -> None:
    sub.add_argument(
        "--endpoint",
        default=None,
        metavar="URL",
        help="also replay the workload (same token ids) against this OpenAI-compatible "
        "server (kvlab serve, vllm serve) and read its /metrics",
    )
    sub.add_argument(
        "--endpoint-model", default=None, help="the model name it serves (default: its first)"
    )


def _replay(args: argparse.Namespace, endpoint: str, model, requests):
    """A ReplayResult (kvlab.serve.replay) of the workload against one endpoint."""
    from kvlab.serve.replay import replay_workload

    ignore_eos = not getattr(args, "stop_at_eos", False)
    return replay_workload(endpoint, model, requests, args.endpoint_model, ignore_eos)


def _replay_endpoint(args: argparse.Namespace, model, requests) -> dict | None:
    """The endpoint's summary row, or None without --endpoint."""
    return _replay(args, args.endpoint, model, requests).summary() if args.endpoint else None


def _print_endpoint(row: dict | None) -> None:
    if row:
        print(f"\nendpoint {row['endpoint']} (its /metrics; latencies on this client's clock):")
        print("\n".join(f"  {key}: {value}" for key, value in row.items() if key != "endpoint"))


def _split(names: str) -> list[str]:
    """Comma-separated names, blanks dropped: 'a, b,,c' -> ['a', 'b', 'c']."""
    return [n.strip() for n in names.split(",") if n.strip()]


def _model_and_budget(args: argparse.Namespace, configs: list[str]):
    """Check the config names (a bad one fails before the model loads), then load the
    model and read --budget (None: the command's default)."""
    import torch

    import kvlab
    from kvlab.experiments.configs import model_bytes_per_token, parse_budget, parse_config

    for name in configs:
        parse_config(name)
    dtype = getattr(torch, args.dtype) if getattr(args, "dtype", None) else None
    model = kvlab.load_model(args.model, device=args.device, dtype=dtype, progress=not args.quiet)
    budget = parse_budget(args.budget, model_bytes_per_token(model)) if args.budget else None
    return model, budget


def run_generate(args: argparse.Namespace) -> int:
    import kvlab

    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    config = EngineConfig(
        cache=args.cache, max_model_len=args.max_model_len, kv_budget_tokens=args.kv_budget_tokens
    )
    model = kvlab.load_model(args.model, device=args.device, progress=not args.json)
    engine = kvlab.Engine(model, config)
    outputs = engine.generate(args.prompts, params, chat=not args.no_chat)
    if args.json:
        rows = [
            {
                "prompt": prompt,
                "text": out.text,
                "token_ids": out.token_ids,
                "finish_reason": out.finish_reason,
                "ttft_s": out.metrics.ttft_s,
                "tpot_s": out.metrics.tpot_s,
            }
            for prompt, out in zip(args.prompts, outputs)
        ]
        print(json.dumps({"model": model.name, "outputs": rows}, indent=2))
    else:
        for prompt, out in zip(args.prompts, outputs):
            print(f">>> {prompt}\n{out.text}\n")
    return 0


def run_compare(args: argparse.Namespace) -> int:
    from kvlab.experiments.compare import compare

    requests = _load_workload(args)
    configs = _split(args.configs)
    model, budget = _model_and_budget(args, configs)
    result = compare(
        model,
        requests,
        configs,
        budget_bytes=budget,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        ignore_eos=not args.stop_at_eos,
        progress=not args.quiet,
        workload=args.workload,
        max_num_seqs=args.max_num_seqs,
    )
    endpoint = _replay_endpoint(args, model, requests)
    if args.html:
        result.write_html(args.html)
    if args.json:
        out = result.to_json()
        print(json.dumps({**out, "endpoint": endpoint} if endpoint else out, indent=2))
    else:
        print(
            f"{args.workload}: {len(requests)} requests, KV budget "
            f"{result.budget_bytes / MiB:.1f} MiB, max_model_len {result.max_model_len}"
        )
        print(result.table().astype(object).T.to_string())
        _print_endpoint(endpoint)
    return 0


def run_bench(args: argparse.Namespace) -> int:
    from kvlab.experiments.bench import PEERS
    from kvlab.experiments.bench import run_bench as bench

    requests = _load_workload(args)
    peers, configs = _split(args.peers), _split(args.configs)
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        raise ValueError(f"unknown peer(s) {unknown}; choose from {PEERS}")
    model, budget = _model_and_budget(args, configs)
    result = bench(
        model,
        requests,
        configs,
        peers,
        budget_bytes=budget,
        max_model_len=args.max_model_len,
        hf_batch_size=args.hf_batch_size,
        rounds=args.rounds,
        progress=not args.quiet,
        workload=args.workload,
        vllm_threads=args.vllm_threads,
    )
    endpoint = _replay_endpoint(args, model, requests)
    if endpoint:
        result.meta["endpoint"] = endpoint
    if args.save:
        result.save(args.save)
    if args.html:
        result.write_html(args.html)
    if args.json:
        out = result.to_json()
        print(json.dumps({**out, "endpoint": endpoint} if endpoint else out, indent=2))
    else:
        print(f"{args.workload}: {len(requests)} requests, greedy, same prompts and lengths")
        print(result.table().to_string())
        for name, ratio in result.ratios().items():
            print(f"{name}: {ratio:.2f}x")
        agreement = result.meta["token_agreement"]
        print(
            "requests token-identical to kvlab:",
            ", ".join(f"{k} {v}" for k, v in agreement.items()),
        )
        if "vllm" in result.meta:
            vllm = result.meta["vllm"]
            print(
                f"vllm {vllm['version']}: engine built in {vllm['load_s']} s (not timed), "
                f"VLLM_CPU_OMP_THREADS_BIND={vllm['VLLM_CPU_OMP_THREADS_BIND']}, "
                f"OpenMP on cores {vllm['omp_core_ids']}"
            )
        _print_endpoint(endpoint)
    return 0


def run_profile(args: argparse.Namespace) -> int:
    from kvlab.experiments.bench import whole_workload_bytes
    from kvlab.experiments.configs import default_max_model_len, model_bytes_per_token, parse_config
    from kvlab.experiments.step_profile import decode_floor, parts_table, profile_steps
    from kvlab.workloads import encode_requests

    model, budget = _model_and_budget(args, [args.config])
    requests = encode_requests(model, _load_workload(args))
    prompts = [list(r.prompt) for r in requests]
    budget = budget or whole_workload_bytes(
        prompts, [r.max_new_tokens for r in requests], model_bytes_per_token(model)
    )
    max_model_len = args.max_model_len or default_max_model_len(model, requests)
    config = parse_config(args.config, kv_budget_bytes=budget, max_model_len=max_model_len)
    steps = profile_steps(model, requests, config, progress=not args.quiet)
    floor = decode_floor(model, steps)
    tables = {
        phase: parts_table(steps, phase)
        for phase in ("prefill", "mixed", "decode")
        if (steps["phase"] == phase).any()
    }
    vllm = _profile_vllm(args, model, prompts, [r.max_new_tokens for r in requests], budget)
    if args.save:
        saved = {"steps": steps.to_dict("records"), "floor": floor.to_json()}
        if vllm is not None:
            meta, run = vllm
            saved["vllm"] = {"meta": meta, "run": dataclasses.asdict(run)}
        with open(args.save, "w") as f:
            json.dump(saved, f, indent=1)
    if args.json:
        out = {phase: t.round(3).to_dict("index") for phase, t in tables.items()}
        print(json.dumps({"parts": out, "floor": floor.to_json()}, indent=2))
        return 0
    dtype = str(model.dtype).removeprefix("torch.")
    print(f"{args.workload}: {len(requests)} requests, {args.config}, {dtype}")
    for phase, table in tables.items():
        count = int((steps["phase"] == phase).sum())
        print(f"\n{phase} steps ({count}), mean per step:")
        print(table.round(2).to_string())
    rates = floor.rates
    print(
        f"\ndecode floor: {floor.floor_ms:.1f} ms per step of {floor.batch_seqs:.1f} sequences "
        f"(bytes {(floor.weight_bytes + floor.kv_bytes) / 1e6:.0f} MB / "
        f"{rates.bandwidth_gb_s:.1f} GB/s copy bandwidth = {floor.bandwidth_ms:.1f} ms; "
        f"{floor.gflop:.2f} GFLOP / {rates.matmul_gflop_s:.0f} GFLOP/s matmul rate = "
        f"{floor.compute_ms:.1f} ms; {rates.threads} torch threads)"
    )
    if vllm is not None:
        _print_vllm_profile(steps, *vllm)
    return 0


def _profile_vllm(args, model, prompts, max_new_tokens, budget):
    """(meta, VllmRun): vLLM's profiled run of the same tokens, with kvlab's torch threads
    (--peer vllm); None without --peer."""
    if args.peer != "vllm":
        return None
    import torch

    from kvlab.experiments.vllm_bench import VllmBenchSide

    threads = torch.get_num_threads()
    if not args.quiet:
        print(f"vllm: starting its engine in one process, {threads} threads", file=sys.stderr)
    side = VllmBenchSide.start(model, prompts, max_new_tokens, budget, threads=threads, inproc=True)
    try:
        return side.meta(), side.run(prompts, max_new_tokens, profile=True)
    finally:
        side.close()


def _print_vllm_profile(steps, meta: dict, run) -> None:
    from kvlab.experiments.peer_profile import parts_table_vs_vllm, phase_table

    print(
        f"\nkvlab beside vLLM {meta['version']} ({meta['mode']}, "
        f"VLLM_CPU_OMP_THREADS_BIND={meta['VLLM_CPU_OMP_THREADS_BIND']}), same tokens:"
    )
    print(phase_table(steps, run).round(2).to_string())
    print("\nseconds per part (vLLM: its operators' self time under torch's profiler):")
    print(parts_table_vs_vllm(steps, run).round(2).to_string())
    print("\nvLLM's costliest operators (self ms):")
    for op in run.ops[:12]:
        print(f"  {op['self_ms']:9.0f}  {op['calls']:7d} calls  {op['op']}")


def run_plan(args: argparse.Namespace) -> int:
    from kvlab.planner import ModelShape, gqa_vs_mha, plan

    shape = ModelShape.from_config(args.model)
    options = dict(
        memory=args.memory,
        weight_dtype=args.weight_dtype,
        kv_codec=args.kv_codec,
        context_len=args.context,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        utilization=args.utilization,
    )
    result = plan(shape, users=args.users, **options)
    mha = plan(shape.with_mha(), users=args.users, **options)
    if args.json:
        print(json.dumps({"plan": result.to_dict(), "mha": mha.to_dict()}, indent=2))
    else:
        print(result.summary())
        print("\nGQA vs MHA (the same model with one KV head per query head):")
        print(gqa_vs_mha(shape, **options).to_string())
    return 0


def run_serve(args: argparse.Namespace) -> int:
    import logging

    import kvlab
    from kvlab.experiments.configs import model_bytes_per_token, parse_budget
    from kvlab.serve import Server, engine_config
    from kvlab.serve.limits import ServeLimits
    from kvlab.serve.tenants import Tenants

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    base = {"max_model_len": args.max_model_len} if args.max_model_len else {}
    engine_config(args.config, **base)  # a bad config fails before the model loads
    tenants = Tenants.from_flags(args.api_key, args.api_keys_file)  # these too
    limits = ServeLimits(
        max_request_bytes=args.max_request_bytes,
        tenant_max_running=args.tenant_max_running,
        tenant_max_queued=args.tenant_max_queued,
    )
    model = kvlab.load_model(args.model, device=args.device, progress=False)
    if args.budget:
        base["kv_budget_bytes"] = parse_budget(args.budget, model_bytes_per_token(model))
    engine = kvlab.Engine(model, engine_config(args.config, **base))
    server = Server(engine, args.served_model_name, tenants, limits)
    server.log_startup()
    server.run(args.host, args.port, args.log_level)
    return 0


def run_replay(args: argparse.Namespace) -> int:
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from kvlab.model.loading import _embedded_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or _embedded_checkpoint(False))
    model, requests = SimpleNamespace(tokenizer=tokenizer), _load_workload(args)
    results = {url: _replay(args, url, model, requests) for url in _split(args.endpoint)}
    rows = [result.summary() for result in results.values()]
    if args.html:
        import pandas as pd

        from kvlab.viz.endpoint import endpoint_figure
        from kvlab.viz.report import write_report

        table = pd.DataFrame(rows).set_index("endpoint")
        note = f"{len(requests)} requests; latencies on the client's clock"
        figures = {"live /metrics and latencies": endpoint_figure(results)}
        write_report(args.html, f"kvlab replay: {args.workload}", note, {"servers": table}, figures)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for row in rows:
            _print_endpoint(row)
    return 0


def run_workload(args: argparse.Namespace) -> int:
    from kvlab.workloads import WORKLOADS, write_jsonl

    if args.name not in WORKLOADS:
        raise ValueError(f"unknown workload {args.name!r}: give one of {list(WORKLOADS)}")
    args.workload = args.name
    requests = _load_workload(args)
    write_jsonl(requests, args.out)
    print(f"wrote {len(requests)} requests to {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except ValueError as err:
        print(f"kvlab: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
