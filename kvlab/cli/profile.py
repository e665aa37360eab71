"""`kvlab profile`: where kvlab's step time goes, part by part, beside the decode floor
(kvlab.experiments.step_profile); --peer vllm profiles vLLM on the same tokens beside it
(kvlab.experiments.peer_profile)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from kvlab.cli.shared import load_workload, model_and_budget, workload_args

HELP = "where kvlab's step time goes, part by part, beside the decode floor"


def add_arguments(prof: argparse.ArgumentParser) -> None:
    workload_args(prof, default="uniform-chat")
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


def run(args: argparse.Namespace) -> int:
    from kvlab.experiments.bench import whole_workload_bytes
    from kvlab.experiments.step_profile import decode_floor, parts_table, profile_steps
    from kvlab.presets import default_max_model_len, model_bytes_per_token, parse_config
    from kvlab.workloads import encode_requests

    model, budget = model_and_budget(args, [args.config])
    requests = encode_requests(model, load_workload(args))
    prompts = [list(r.prompt) for r in requests]
    budget = budget or whole_workload_bytes(
        prompts, [r.max_new_tokens for r in requests], model_bytes_per_token(model)
    )
    max_model_len = args.max_model_len or default_max_model_len(model, requests)
    config = parse_config(args.config, kv_budget_bytes=budget, max_model_len=max_model_len)
    steps = profile_steps(model, requests, config, progress=not args.quiet)
    floor = decode_floor(model, steps, time_matmuls=True)
    tables = {
        phase: parts_table(steps, phase)
        for phase in ("prefill", "mixed", "decode")
        if (steps["phase"] == phase).any()
    }
    vllm = _profile_vllm(args, model, prompts, [r.max_new_tokens for r in requests], budget)
    if args.save:
        saved = {"steps": steps.to_dict("records"), "floor": floor.to_json()}
        if vllm is not None:
            meta, vllm_run = vllm
            saved["vllm"] = {"meta": meta, "run": dataclasses.asdict(vllm_run)}
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
    if floor.matmuls_best_ms:
        alone = ", ".join(f"{name} {ms:.1f} ms" for name, ms in floor.matmuls_alone_ms.items())
        in_step = tables["decode"].loc["matmuls", "ms per step"]
        rate = floor.matmul_gflop / (floor.matmuls_best_ms / 1e3)
        print(
            f"the step's matmuls alone ({round(floor.batch_seqs)} rows, every weight once): "
            f"{alone}; in the step {in_step:.1f} ms, "
            f"{100 * floor.matmuls_best_ms / in_step:.0f}% of the best rate alone "
            f"({rate:.0f} GFLOP/s)"
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

    from kvlab.peers.vllm_bench import VllmBenchSide

    threads = torch.get_num_threads()
    if not args.quiet:
        print(f"vllm: starting its engine in one process, {threads} threads", file=sys.stderr)
    # eager at block 32 (start's defaults: step for step beside kvlab, and named so:
    # "vllm (eager, block 32)"), stats on for its per-step rows: a profile, not a timing
    side = VllmBenchSide.start(
        model, prompts, max_new_tokens, budget, threads=threads, inproc=True, stats=True
    )
    try:
        return side.meta(), side.run(prompts, max_new_tokens, profile=True)
    finally:
        side.close()


def _print_vllm_profile(steps, meta: dict, vllm_run) -> None:
    from kvlab.experiments.peer_profile import parts_table_vs_vllm, phase_table

    print(
        f"\nkvlab beside vLLM {meta['version']} as {meta['system']!r} ({meta['mode']}, "
        f"VLLM_CPU_OMP_THREADS_BIND={meta['VLLM_CPU_OMP_THREADS_BIND']}), same tokens:"
    )
    print(phase_table(steps, vllm_run).round(2).to_string())
    print("\nseconds per part (vLLM: its operators' self time under torch's profiler):")
    print(parts_table_vs_vllm(steps, vllm_run).round(2).to_string())
    print("\nvLLM's costliest operators (self ms):")
    for op in vllm_run.ops[:12]:
        print(f"  {op['self_ms']:9.0f}  {op['calls']:7d} calls  {op['op']}")
