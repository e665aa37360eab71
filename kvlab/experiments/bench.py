"""kvlab against what users would otherwise run: HF transformers and vLLM, same prompts.

    result = run_bench(model, doc_qa(16), peers=("hf-generate", "hf-generate-batch"))
    result.to_json()  # {"systems": {name: {"output_tokens", "wall_s", "tok_s", "cpu_percent"}},
    #                     "ratios": {...}, "token_agreement": {name: share of requests}}
    result.save("bench.json"); bench_figure(BenchResult.load("bench.json"))  # kvlab.viz.bench

Every system gets the same token-id prompts, greedy decoding and each request's own
max_new_tokens, with EOS ignored so all produce the same number of tokens. Systems run
in one process, one after another; with `rounds` > 1 the order alternates (forward,
then reversed) and each system's fastest round is kept (this machine is shared: the
fastest round is the least disturbed; the saved result also gives median_ratios, from
each system's median round). A tiny untimed warm-up precedes the first round.

Wall time includes each system's set-up: kvlab's Engine construction and
transformers' continuous-batching manager start-up and shut-down. vLLM (peer "vllm",
kvlab.peers.vllm_bench) runs in a process of its own whose engine is built once,
before the rounds: its load time is in meta["vllm"], its rounds time generation only.
Every system's CPU time is kept (cpu_percent: CPU seconds over wall seconds; vLLM's sums
its processes), and so is its token agreement with kvlab: meta["token_agreement"], the
share of requests whose tokens equal kvlab's exactly.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch
from tqdm.auto import tqdm

from kvlab.build import Engine
from kvlab.model.loading import LoadedModel
from kvlab.peers.hf import choose_batch_size, hf_generate, hf_generate_batch
from kvlab.presets import default_max_model_len, model_bytes_per_token, parse_config
from kvlab.units import ceil_div, round_up
from kvlab.workloads import Request, encode_requests

PEERS = ("hf-generate", "hf-generate-batch", "vllm")
DEFAULT_PEERS = ("hf-generate", "hf-generate-batch")  # "vllm" needs `make peers`
DEFAULT_KVLAB_CONFIG = "paged+prefix"


def is_kvlab(name: str) -> bool:
    return name == "kvlab" or name.startswith("kvlab-")


@dataclass
class SystemResult:
    """One system's best round."""

    name: str
    output_tokens: int
    wall_s: float
    batch_size: int | None = None  # hf-generate's static batch size
    walls_s: list[float] = field(default_factory=list)  # every timed round
    outputs: list[list[int]] = field(default_factory=list, repr=False)
    cpu_s: float | None = None  # CPU seconds of the round (all threads and processes)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def cpu_percent(self) -> float | None:
        return None if self.cpu_s is None else round(100 * self.cpu_s / self.wall_s, 1)


@dataclass
class BenchResult:
    workload: str
    systems: dict[str, SystemResult]
    meta: dict = field(default_factory=dict)

    def ratios(self) -> dict[str, float]:
        """tok/s of every kvlab entry over every peer's: {"kvlab/hf-generate": 2.1, ...}."""
        ours = [s for s in self.systems.values() if is_kvlab(s.name)]
        theirs = [s for s in self.systems.values() if not is_kvlab(s.name)]
        return {f"{a.name}/{b.name}": round(a.tok_s / b.tok_s, 3) for a in ours for b in theirs}

    def median_ratios(self) -> dict[str, float]:
        """As ratios(), from each system's median round instead of its fastest (with
        several rounds, the other fair summary of a noisy machine)."""

        def rate(s: SystemResult) -> float:
            return s.output_tokens / statistics.median(s.walls_s or [s.wall_s])

        ours = [s for s in self.systems.values() if is_kvlab(s.name)]
        theirs = [s for s in self.systems.values() if not is_kvlab(s.name)]
        return {f"{a.name}/{b.name}": round(rate(a) / rate(b), 3) for a in ours for b in theirs}

    def to_json(self) -> dict:
        """What `kvlab bench --json` prints."""
        systems = {
            name: {
                "output_tokens": s.output_tokens,
                "wall_s": round(s.wall_s, 3),
                "tok_s": round(s.tok_s, 2),
                "cpu_percent": s.cpu_percent,
            }
            for name, s in self.systems.items()
        }
        agreement = self.meta.get("token_agreement", {})
        return {"systems": systems, "ratios": self.ratios(), "token_agreement": agreement}

    def to_dict(self) -> dict:
        """to_json() plus the workload, batch sizes, every round's wall time and meta."""
        details = {
            name: {
                "batch_size": s.batch_size,
                "best_wall_s": s.wall_s,  # unrounded, so a reloaded result is the same
                "walls_s": [round(w, 3) for w in s.walls_s],
            }
            for name, s in self.systems.items()
        }
        return {
            **self.to_json(),
            "median_ratios": self.median_ratios(),
            "workload": self.workload,
            "details": details,
            "meta": self.meta,
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> BenchResult:
        """A result saved by `save` (or printed by `kvlab bench --json`)."""
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        details = data.get("details", {})
        systems = {}
        for name, row in data["systems"].items():
            detail = details.get(name, {})
            wall = detail.get("best_wall_s", row["wall_s"])
            cpu = row.get("cpu_percent")
            systems[name] = SystemResult(
                name,
                row["output_tokens"],
                wall,
                detail.get("batch_size"),
                detail.get("walls_s", [row["wall_s"]]),
                cpu_s=None if cpu is None else cpu * wall / 100,
            )
        return cls(data.get("workload", str(path)), systems, data.get("meta", {}))

    def table(self) -> pd.DataFrame:
        rows = {
            name: {
                "output_tokens": s.output_tokens,
                "wall_s": round(s.wall_s, 2),
                "tok_s": round(s.tok_s, 1),
                "batch_size": s.batch_size,
                "cpu_percent": s.cpu_percent,
            }
            for name, s in self.systems.items()
        }
        frame = pd.DataFrame.from_dict(rows, orient="index")
        return frame.astype({"batch_size": "Int64"})

    def peer_rates(self, prefix: str = "") -> dict[str, float]:
        """{name: tok/s} of every system (for bars beside a live run), names prefixed."""
        return {f"{prefix}{name}": round(s.tok_s, 2) for name, s in self.systems.items()}


def _first_eos_prefix(tokens: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i]
    return tokens


def whole_workload_bytes(prompts: list[list[int]], max_new: list[int], per_token: int) -> int:
    """KV bytes that hold every request at once: prompt + max_new_tokens, in 16-token
    blocks (the benchmark's default budget: no system waits for memory)."""
    return sum(round_up(len(p) + n, 16) for p, n in zip(prompts, max_new)) * per_token


def run_bench(
    model: LoadedModel,
    requests: list[Request],
    configs: list[str] | tuple[str, ...] = (DEFAULT_KVLAB_CONFIG,),
    peers: list[str] | tuple[str, ...] = DEFAULT_PEERS,
    budget_bytes: int | None = None,
    max_model_len: int | None = None,
    hf_batch_size: int | None = None,
    rounds: int = 1,
    warmup: bool = True,
    progress: bool = False,
    workload: str = "custom",
    vllm_threads: int | None = None,
    vllm_inproc: bool = False,
    **engine_options,
) -> BenchResult:
    """Run `requests` through kvlab (each config) and the peers; see the module doc.

    Args:
        configs: kvlab config names (`kvlab.experiments.compare.parse_config`); one is reported as
            "kvlab", several as "kvlab-<name>".
        peers: any of PEERS ("vllm" needs `make peers`; see kvlab.peers.vllm_bench).
        budget_bytes: KV budget for kvlab and for hf-generate-batch's cache, and the
            memory hf-generate's batch size is chosen to fit; default: the whole workload
            at once (every request's prompt + max_new_tokens, in 16-token blocks).
        hf_batch_size: hf-generate's static batch size; default `choose_batch_size`
            (16, or the largest padded batch that fits the budget).
        vllm_threads: vLLM's OpenMP threads (cores 0..N-1); None: vLLM's own binding.
        vllm_inproc: vLLM's whole engine in one process (one import of vLLM instead of
            three: it starts in ~10 s instead of ~25 s here; the meta's "mode" says which).
    """
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        raise ValueError(f"unknown peer(s) {unknown}; choose from {PEERS}")
    if rounds < 1:
        raise ValueError(f"rounds={rounds} must be >= 1")
    if not requests:
        raise ValueError("the workload has no requests")
    requests = encode_requests(model, requests)
    prompts = [list(r.prompt) for r in requests]
    max_new = [r.max_new_tokens for r in requests]
    per_token = model_bytes_per_token(model)
    max_model_len = max_model_len or default_max_model_len(model, requests)
    if budget_bytes is None:
        budget_bytes = whole_workload_bytes(prompts, max_new, per_token)
    kvlab_configs = {
        ("kvlab" if len(configs) == 1 else f"kvlab-{name}"): parse_config(
            name, kv_budget_bytes=budget_bytes, max_model_len=max_model_len, **engine_options
        )
        for name in configs
    }
    batch_size = hf_batch_size or choose_batch_size(
        [len(p) for p in prompts], max_new, budget_bytes, per_token
    )
    page_size = 256
    first_config = next(iter(kvlab_configs.values()))
    step_tokens = first_config.max_num_batched_tokens
    vllm = None
    if "vllm" in peers:  # its engine is built here, before any timed round
        from kvlab.peers.vllm_bench import VllmBenchSide

        if progress:
            tqdm.write("vllm: starting its engine (not timed)", file=sys.stderr)
        vllm = VllmBenchSide.start(
            model,
            prompts,
            max_new,
            budget_bytes,
            first_config.max_num_seqs,
            step_tokens,
            vllm_threads,
            inproc=vllm_inproc,
        )

    def run(name: str, reqs: list[Request], show: bool) -> SystemResult:
        ids, new = [list(r.prompt) for r in reqs], [r.max_new_tokens for r in reqs]
        if show:
            tqdm.write(name, file=sys.stderr)
        if name == "vllm":
            done = vllm.run(ids, new)
            tokens = sum(map(len, done.outputs))
            return SystemResult(name, tokens, done.run_s, None, [], done.outputs, done.cpu_s)
        cpu0 = time.process_time()  # this process's CPU seconds, every thread
        result = run_here(name, reqs, ids, new, show)
        result.cpu_s = time.process_time() - cpu0
        return result

    def run_here(name, reqs, ids, new, show) -> SystemResult:
        if is_kvlab(name):
            start = time.perf_counter()
            engine = Engine(model, kvlab_configs[name])
            outs = engine.run(reqs, ignore_eos=True, progress=show)
            wall = time.perf_counter() - start
            outputs = [o.token_ids for o in outs]
            return SystemResult(name, sum(map(len, outputs)), wall, outputs=outputs)
        if name == "hf-generate":
            peer = hf_generate(model, ids, new, batch_size, ignore_eos=True, progress=show)
        else:
            num_blocks = ceil_div(budget_bytes, page_size * per_token)
            peer = hf_generate_batch(
                model, ids, new, num_blocks, page_size, step_tokens, progress=show
            )
        return SystemResult(
            name, peer.output_tokens, peer.wall_s, peer.batch_size, [], peer.outputs
        )

    systems = [*kvlab_configs, *peers]
    best: dict[str, SystemResult] = {}
    load_average = os.getloadavg() if hasattr(os, "getloadavg") else ()
    try:
        if warmup:  # one short request each, untimed: first-call costs land here
            tiny = [Request(prompts[0][:16], 2)]
            for name in systems:
                run(name, tiny, False)
        for index in range(rounds):
            order = systems if index % 2 == 0 else systems[::-1]
            for name in order:
                result = run(name, requests, progress)
                walls = [*best[name].walls_s, result.wall_s] if name in best else [result.wall_s]
                if name not in best or result.wall_s < best[name].wall_s:
                    best[name] = result
                best[name].walls_s = walls
    finally:
        if vllm is not None:
            vllm.close()
    eos = {model.tokenizer.eos_token_id}
    reference = best[next(iter(kvlab_configs))].outputs
    agreement = {
        name: round(
            sum(
                _first_eos_prefix(a, eos) == b[: len(_first_eos_prefix(a, eos))]
                for a, b in zip(reference, s.outputs)
            )
            / len(reference),
            3,
        )
        for name, s in best.items()
    }
    meta = {
        "model": model.name,
        "device": str(model.device),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads",
        "load_average_at_start": [round(x, 2) for x in load_average],  # other work on it
        "requests": len(requests),
        "prompt_tokens": sum(map(len, prompts)),
        "max_new_tokens": sum(max_new),
        "kv_budget_bytes": budget_bytes,
        "max_model_len": max_model_len,
        "kvlab_configs": list(configs),
        "hf_generate_batch_size": batch_size if "hf-generate" in peers else None,
        "rounds": rounds,
        "order": systems,
        "greedy_match_to_first_eos": agreement,
        "token_agreement": {
            name: round(sum(a == b for a, b in zip(reference, s.outputs)) / len(reference), 3)
            for name, s in best.items()
        },
    }
    if vllm is not None:
        meta["vllm"] = vllm.meta()
    return BenchResult(workload, {name: best[name] for name in systems}, meta)
