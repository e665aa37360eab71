"""kvlab against what users would otherwise run: HF transformers and vLLM, same prompts.

    result = run_bench(model, doc_qa(16), peers=("hf-generate", "vllm", "vllm-eager"))
    result.to_json()  # {"systems": {name: {"output_tokens", "wall_s", "tok_s", "median_wall_s",
    #   "median_tok_s", "spread", "cpu_percent", "cpu_s_per_token"}}, "ratios", "median_ratios",
    #   "token_agreement"}
    result.save("bench.json"); bench_figure(BenchResult.load("bench.json"))  # kvlab.viz.bench

Every system gets the same token-id prompts, greedy decoding and each request's own
max_new_tokens, with EOS ignored so all produce the same number of tokens. Systems run
one after another; first each runs the whole workload once, untimed (a warm-up pass:
first-call costs, vLLM's compiled graphs, allocator growth), then `rounds` timed rounds
(5 by default where there are peers, 1 for kvlab alone) whose order alternates (forward,
then reversed). Each system reports its fastest round (wall_s, tok_s: the least disturbed
on a shared machine), its median round, the spread (slowest wall over fastest) and the
CPU seconds its processes spent per output token (median over rounds; psutil: the
process and its children, vLLM's summed over its processes). ratios come from the
fastest rounds, median_ratios from the median ones.

Wall time includes each system's set-up: kvlab's Engine construction and
transformers' continuous-batching manager start-up and shut-down. vLLM (peer "vllm",
kvlab.peers.vllm_bench) runs in a process of its own at its defaults (compiled with
torch.compile, its CPU build's block size 128); peer "vllm-eager" is the same engine
with enforce_eager, reported as "vllm (eager)". Each vLLM engine is built once, before
the rounds: its load time (the compile included) is in meta[name], its rounds time
generation only, with vLLM's stats logging off (`vllm.LLM`'s default). With
`same_block_size`, each kvlab config also runs at vLLM's block size (a second line,
"kvlab-<config>+bs128"). Without a budget, each system's KV holds the whole workload at
its own block size: kvlab's 16-token blocks, vLLM's 128-token blocks plus its null block,
and transformers' `generate_batch` every request at once in its own 256-token pages, plus
the free share its scheduler keeps (`kvlab.peers.hf.pages_for_all`), so it can run as many
requests at once as kvlab (meta["hf_generate_batch_pages"]); with a budget, each gets
those bytes, counted in its own blocks or pages. The share of requests whose tokens
equal kvlab's exactly is meta["token_agreement"]. `provenance(result, command)` names the CPU,
its flags, the thread binding, the date and the command (benchmarks/stamp.py's block).
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import psutil
import torch
from tqdm.auto import tqdm

from kvlab.build import Engine
from kvlab.model.host_memory import keep_freed_memory
from kvlab.model.loading import LoadedModel
from kvlab.peers.hf import (
    PAGE_SIZE,
    choose_batch_size,
    hf_generate,
    hf_generate_batch,
    pages_for_all,
)
from kvlab.peers.vllm_peer import VLLM_CPU_DEFAULT_BLOCK_SIZE
from kvlab.presets import default_max_model_len, model_bytes_per_token, parse_config
from kvlab.units import ceil_div, round_up
from kvlab.workloads import Request, encode_requests

PEERS = ("hf-generate", "hf-generate-batch", "vllm", "vllm-eager")
DEFAULT_PEERS = ("hf-generate", "hf-generate-batch")  # the vLLM peers need `make peers`
VLLM_PEERS = {"vllm": "vllm", "vllm-eager": "vllm (eager)"}  # peer -> its system name
DEFAULT_KVLAB_CONFIG = "paged+prefix"
PEER_ROUNDS = 5  # the default rounds where there are peers (kvlab alone: 1)
# vLLM's model worker spins on its message queue for 1 s after its last message
# (shm_broadcast's busy_loop_s): with a vLLM peer, each run starts after this much quiet.
VLLM_BUSY_LOOP_S = 1.5


def is_kvlab(name: str) -> bool:
    return name == "kvlab" or name.startswith("kvlab-")


def system_name(peer: str) -> str:
    """A peer's name in results: "vllm-eager" reports as "vllm (eager)"."""
    return VLLM_PEERS.get(peer, peer)


def cpu_seconds(skip: tuple[int, ...] = ()) -> float:
    """User + system CPU seconds of this process (every thread) and its live children,
    but for the process trees rooted at `skip` (the vLLM workers: a system of their own)."""
    me = psutil.Process()
    skipped = set(skip)
    for pid in skip:
        try:
            skipped.update(child.pid for child in psutil.Process(pid).children(recursive=True))
        except (psutil.Error, ValueError):  # gone, or no process id
            pass
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        if proc.pid in skipped:
            continue
        try:
            times = proc.cpu_times()
            total += times.user + times.system
        except psutil.Error:
            pass
    return total


@dataclass
class SystemResult:
    """One system's best round, with every round's wall and CPU seconds."""

    name: str
    output_tokens: int
    wall_s: float
    batch_size: int | None = None  # hf-generate's static batch size
    walls_s: list[float] = field(default_factory=list)  # every timed round
    outputs: list[list[int]] = field(default_factory=list, repr=False)
    cpu_s: float | None = None  # CPU seconds of the round (all threads and processes)
    cpus_s: list[float] = field(default_factory=list)  # every timed round's CPU seconds

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def cpu_percent(self) -> float | None:
        return None if self.cpu_s is None else round(100 * self.cpu_s / self.wall_s, 1)

    @property
    def median_wall_s(self) -> float:
        return statistics.median(self.walls_s or [self.wall_s])

    @property
    def median_tok_s(self) -> float:
        return self.output_tokens / self.median_wall_s

    @property
    def spread(self) -> float:
        """The slowest round's wall time over the fastest's (1.0: one round, or no noise)."""
        walls = self.walls_s or [self.wall_s]
        return max(walls) / min(walls)

    @property
    def cpu_s_per_token(self) -> float | None:
        """CPU seconds its processes spent per output token, median over the rounds."""
        cpus = self.cpus_s or ([] if self.cpu_s is None else [self.cpu_s])
        if not cpus or not self.output_tokens:
            return None
        return statistics.median(cpus) / self.output_tokens


@dataclass
class BenchResult:
    workload: str
    systems: dict[str, SystemResult]
    meta: dict = field(default_factory=dict)
    provenance: dict = field(default_factory=dict)  # provenance(result, command); saved first

    def ratios(self) -> dict[str, float]:
        """tok/s of every kvlab entry over every peer's: {"kvlab/hf-generate": 2.1, ...}."""
        ours = [s for s in self.systems.values() if is_kvlab(s.name)]
        theirs = [s for s in self.systems.values() if not is_kvlab(s.name)]
        return {f"{a.name}/{b.name}": round(a.tok_s / b.tok_s, 3) for a in ours for b in theirs}

    def median_ratios(self) -> dict[str, float]:
        """As ratios(), from each system's median round instead of its fastest (with
        several rounds, the other fair summary of a noisy machine)."""

        ours = [s for s in self.systems.values() if is_kvlab(s.name)]
        theirs = [s for s in self.systems.values() if not is_kvlab(s.name)]
        return {
            f"{a.name}/{b.name}": round(a.median_tok_s / b.median_tok_s, 3)
            for a in ours
            for b in theirs
        }

    def to_json(self) -> dict:
        """What `kvlab bench --json` prints."""
        systems = {
            name: {
                "output_tokens": s.output_tokens,
                "wall_s": round(s.wall_s, 3),  # the fastest round
                "tok_s": round(s.tok_s, 2),
                "median_wall_s": round(s.median_wall_s, 3),
                "median_tok_s": round(s.median_tok_s, 2),
                "spread": round(s.spread, 3),  # slowest round's wall / fastest's
                "cpu_percent": s.cpu_percent,
                "cpu_s_per_token": None
                if s.cpu_s_per_token is None
                else round(s.cpu_s_per_token, 5),
            }
            for name, s in self.systems.items()
        }
        agreement = self.meta.get("token_agreement", {})
        return {
            "systems": systems,
            "ratios": self.ratios(),
            "median_ratios": self.median_ratios(),
            "token_agreement": agreement,
        }

    def to_dict(self) -> dict:
        """The provenance (when set), to_json(), the workload, batch sizes, every round's
        wall and CPU seconds, and meta."""
        details = {
            name: {
                "batch_size": s.batch_size,
                "best_wall_s": s.wall_s,  # unrounded, so a reloaded result is the same
                "walls_s": [round(w, 6) for w in s.walls_s],  # to the µs: ratios reload
                "cpus_s": [round(c, 3) for c in s.cpus_s],
            }
            for name, s in self.systems.items()
        }
        head = {"provenance": self.provenance} if self.provenance else {}
        return {
            **head,
            **self.to_json(),
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
                cpus_s=detail.get("cpus_s", []),
            )
        workload, meta = data.get("workload", str(path)), data.get("meta", {})
        return cls(workload, systems, meta, data.get("provenance", {}))

    def table(self) -> pd.DataFrame:
        """One row per system: its fastest and median rounds, their spread, its CPU."""
        rows = {
            name: {
                "output_tokens": s.output_tokens,
                "min_wall_s": round(s.wall_s, 2),
                "median_wall_s": round(s.median_wall_s, 2),
                "spread": round(s.spread, 2),
                "best_tok_s": round(s.tok_s, 1),
                "median_tok_s": round(s.median_tok_s, 1),
                "cpu_percent": s.cpu_percent,
                "cpu_s_per_token": None
                if s.cpu_s_per_token is None
                else round(s.cpu_s_per_token, 4),
                "batch_size": s.batch_size,
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


def whole_workload_bytes(
    prompts: list[list[int]], max_new: list[int], per_token: int, block: int = 16
) -> int:
    """KV bytes that hold every request at once: prompt + max_new_tokens, in `block`-token
    blocks (the benchmark's default budget: no system waits for memory)."""
    return sum(round_up(len(p) + n, block) for p, n in zip(prompts, max_new)) * per_token


def run_bench(
    model: LoadedModel,
    requests: list[Request],
    configs: list[str] | tuple[str, ...] = (DEFAULT_KVLAB_CONFIG,),
    peers: list[str] | tuple[str, ...] = DEFAULT_PEERS,
    budget_bytes: int | None = None,
    max_model_len: int | None = None,
    hf_batch_size: int | None = None,
    rounds: int | None = None,
    warmup: bool = True,
    progress: bool = False,
    workload: str = "custom",
    vllm_threads: int | None = None,
    vllm_inproc: bool = False,
    same_block_size: bool = False,
    **engine_options,
) -> BenchResult:
    """Run `requests` through kvlab (each config) and the peers; see the module doc.

    Args:
        configs: kvlab config names (`kvlab.presets.parse_config`); one is reported as
            "kvlab", several as "kvlab-<name>".
        peers: any of PEERS ("vllm", "vllm-eager" need `make peers`; kvlab.peers.vllm_bench).
        budget_bytes: KV budget for every system (vLLM's raised to one max_model_len
            sequence where smaller; hf-generate-batch's in whole pages), and the memory
            hf-generate's batch size is chosen to fit; default: the whole workload at
            once, at each system's block (or page) size.
        hf_batch_size: hf-generate's static batch size; default `choose_batch_size`
            (16, or the largest padded batch that fits the budget).
        rounds: timed rounds, alternating order; default PEER_ROUNDS with peers, else 1.
        warmup: one untimed pass of the whole workload per system before the rounds.
        vllm_threads: vLLM's OpenMP threads (cores 0..N-1); None: vLLM's own binding.
        vllm_inproc: vLLM's whole engine in one process (one import of vLLM instead of
            three: it starts in ~10 s instead of ~25 s here; the meta's "mode" says which).
        same_block_size: also run each kvlab config at vLLM's CPU block size (128), as
            "<config>+bs128" (needs a vLLM peer).
    """
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        raise ValueError(f"unknown peer(s) {unknown}; choose from {PEERS}")
    rounds = rounds if rounds is not None else (PEER_ROUNDS if peers else 1)
    if rounds < 1:
        raise ValueError(f"rounds={rounds} must be >= 1")
    if not requests:
        raise ValueError("the workload has no requests")
    vllm_peers = [p for p in peers if p in VLLM_PEERS]
    if same_block_size and not vllm_peers:
        raise ValueError(f"same_block_size needs a vLLM peer ({list(VLLM_PEERS)}) in peers")
    requests = encode_requests(model, requests)
    prompts = [list(r.prompt) for r in requests]
    max_new = [r.max_new_tokens for r in requests]
    per_token = model_bytes_per_token(model)
    max_model_len = max_model_len or default_max_model_len(model, requests)
    vllm_block = VLLM_CPU_DEFAULT_BLOCK_SIZE

    def budget_at(block: int) -> int:
        """The given budget, or the whole workload in blocks of `block` tokens."""
        if budget_bytes is not None:
            return budget_bytes
        return whole_workload_bytes(prompts, max_new, per_token, block)

    names = list(configs)
    if same_block_size:
        names += [f"{c}+bs{vllm_block}" for c in configs if not c.endswith(f"+bs{vllm_block}")]
    kvlab_configs, budgets = {}, {}
    for name in names:
        system = "kvlab" if len(names) == 1 else f"kvlab-{name}"
        block = parse_config(name, max_model_len=max_model_len, **engine_options).block_size
        budgets[system] = budget_at(block)
        kvlab_configs[system] = parse_config(
            name, kv_budget_bytes=budgets[system], max_model_len=max_model_len, **engine_options
        )
    base_budget = budget_at(16)
    batch_size = hf_batch_size or choose_batch_size(
        [len(p) for p in prompts], max_new, base_budget, per_token
    )
    page_size = PAGE_SIZE
    if budget_bytes is None:  # every request at once, in its own pages (kvlab.peers.hf)
        hf_pages = pages_for_all([len(p) for p in prompts], max_new, page_size)
    else:  # the same bytes, counted in its pages
        hf_pages = ceil_div(budget_bytes, page_size * per_token)
    first_config = next(iter(kvlab_configs.values()))
    step_tokens = first_config.max_num_batched_tokens
    systems = [*kvlab_configs, *map(system_name, peers)]
    for peer in peers:
        if peer not in VLLM_PEERS:
            budgets[system_name(peer)] = base_budget
    if "hf-generate-batch" in peers:
        budgets["hf-generate-batch"] = hf_pages * page_size * per_token
    ids = [list(r.prompt) for r in requests]

    def run(name: str, show: bool) -> SystemResult:
        if show:
            tqdm.write(name, file=sys.stderr)
        if name in vllm:  # its worker sums the CPU of its processes
            done = vllm[name].run(ids, max_new)
            tokens = sum(map(len, done.outputs))
            return SystemResult(name, tokens, done.run_s, None, [], done.outputs, done.cpu_s)
        workers = tuple(side.pid for side in vllm.values())
        cpu0 = cpu_seconds(skip=workers)
        result = run_here(name, show)
        result.cpu_s = cpu_seconds(skip=workers) - cpu0
        return result

    def run_here(name: str, show: bool) -> SystemResult:
        if is_kvlab(name):
            start = time.perf_counter()
            engine = Engine(model, kvlab_configs[name])
            outs = engine.run(requests, ignore_eos=True, progress=show)
            wall = time.perf_counter() - start
            outputs = [o.token_ids for o in outs]
            return SystemResult(name, sum(map(len, outputs)), wall, outputs=outputs)
        if name == "hf-generate":
            peer = hf_generate(model, ids, max_new, batch_size, ignore_eos=True, progress=show)
        else:
            peer = hf_generate_batch(
                model, ids, max_new, hf_pages, page_size, step_tokens, progress=show
            )
        return SystemResult(
            name, peer.output_tokens, peer.wall_s, peer.batch_size, [], peer.outputs
        )

    vllm: dict = {}  # system name -> its started VllmBenchSide
    load_average = _load_average()
    try:
        for peer in vllm_peers:  # each engine is built here, before any timed round
            from kvlab.peers.vllm_bench import VllmBenchSide

            name = system_name(peer)
            if progress:
                tqdm.write(f"{name}: starting its engine (not timed)", file=sys.stderr)
            budgets[name] = budget_at(vllm_block)
            if budget_bytes is None:  # the whole workload at its block size, + its null block
                budgets[name] += vllm_block * per_token
            vllm[name] = VllmBenchSide.start(
                model,
                prompts,
                max_new,
                budgets[name],
                first_config.max_num_seqs,
                step_tokens,
                vllm_threads,
                inproc=vllm_inproc,
                eager=peer == "vllm-eager",
                block_size=None,  # vLLM's own
            )
        pause_s = VLLM_BUSY_LOOP_S if vllm else 0.0
        best, orders = _rounds(systems, run, rounds, warmup, progress, pause_s)
    finally:
        for side in vllm.values():
            side.close()
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
        "dtype": str(model.dtype).removeprefix("torch."),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads",
        "torch_threads": torch.get_num_threads(),
        "cpu_affinity": sorted(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else None,
        "nice": os.nice(0) if hasattr(os, "nice") else None,
        "load_average_at_start": load_average,  # other work on the machine
        # host malloc: kvlab's CPU runners keep freed memory (kvlab.model.host_memory);
        # what the environment sets for every process (vLLM's too): glibc's MALLOC_*
        # tunables, a preloaded allocator (vLLM's docs recommend tcmalloc)
        "kvlab_keeps_freed_memory": model.device.type == "cpu" and keep_freed_memory(),
        "malloc_environment": {
            k: v for k, v in os.environ.items() if k.startswith("MALLOC_") or k == "LD_PRELOAD"
        },
        "requests": len(requests),
        "prompt_tokens": sum(map(len, prompts)),
        "max_new_tokens": sum(max_new),
        "kv_budget_bytes": base_budget,
        "kv_budget_bytes_by_system": budgets,
        "max_model_len": max_model_len,
        "kvlab_configs": names,
        "hf_generate_batch_size": batch_size if "hf-generate" in peers else None,
        "hf_generate_batch_pages": hf_pages if "hf-generate-batch" in peers else None,
        "hf_page_size": page_size if "hf-generate-batch" in peers else None,
        "warmup": "one untimed pass of the whole workload per system" if warmup else None,
        "pause_before_each_run_s": VLLM_BUSY_LOOP_S if vllm else 0.0,
        "rounds": rounds,
        "order": systems,
        "round_orders": orders,
        "greedy_match_to_first_eos": agreement,
        "token_agreement": {
            name: round(sum(a == b for a, b in zip(reference, s.outputs)) / len(reference), 3)
            for name, s in best.items()
        },
    }
    for name, side in vllm.items():
        meta[name] = side.meta()
    return BenchResult(workload, {name: best[name] for name in systems}, meta)


def _load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else []


def _rounds(
    systems: list[str], run, rounds: int, warmup: bool, progress: bool, pause_s: float = 0.0
) -> tuple[dict[str, SystemResult], list[list[str]]]:
    """The warm-up pass and the timed rounds of `run(name, show) -> SystemResult`, with
    `pause_s` of quiet before each run: each system's fastest round (with every round's
    wall and CPU seconds), and each round's order."""
    if warmup:  # the whole workload once each, untimed: compiles and first calls land here
        if progress:
            tqdm.write("warm-up pass (not timed)", file=sys.stderr)
        for name in systems:
            time.sleep(pause_s)
            run(name, False)
    seen: dict[str, list[SystemResult]] = {name: [] for name in systems}
    orders = []
    for index in range(rounds):
        order = systems if index % 2 == 0 else systems[::-1]
        orders.append(list(order))
        for name in order:
            time.sleep(pause_s)
            seen[name].append(run(name, progress))
    best = {}
    for name, results in seen.items():
        best[name] = min(results, key=lambda r: r.wall_s)
        best[name].walls_s = [r.wall_s for r in results]
        best[name].cpus_s = [r.cpu_s for r in results if r.cpu_s is not None]
    return best, orders


def _stamp_module():
    """benchmarks/stamp.py of this checkout (None in an installed kvlab without it)."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "stamp.py"
    if not path.exists():
        return None
    spec = importlib.util.spec_from_file_location("kvlab_benchmarks_stamp", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def thread_binding(meta: dict) -> str:
    """Where each system's threads ran, in a line, from a run_bench meta."""
    line = (
        f"kvlab and HF in one process: {meta.get('torch_threads')} torch threads, "
        f"cores {meta.get('cpu_affinity')}, nice {meta.get('nice')}"
    )
    for name in VLLM_PEERS.values():
        vllm = meta.get(name)
        if vllm:
            line += (
                f"; {name} {vllm['version']} ({vllm['mode']}): VLLM_CPU_OMP_THREADS_BIND="
                f"{vllm['VLLM_CPU_OMP_THREADS_BIND']}, OpenMP on cores {vllm['omp_core_ids']}"
            )
    return line


def provenance(result: BenchResult, command: str) -> dict:
    """The block every saved result carries (benchmarks/stamp.py's: benchmark, machine
    class, CPU and its flags, date, command, rounds) plus the thread binding."""
    meta = result.meta
    rounds = meta.get("rounds", 1)
    benchmark = (
        f"kvlab bench, {result.workload}: {meta.get('requests')} requests, "
        f"{meta.get('prompt_tokens')} prompt tokens, {meta.get('max_new_tokens')} new, "
        f"{meta.get('dtype')}, greedy; {', '.join(result.systems)}; {rounds} alternating "
        f"rounds after {'an untimed warm-up pass' if meta.get('warmup') else 'no warm-up'}"
    )
    stamp = _stamp_module()
    if stamp is not None:
        block = stamp.provenance(benchmark, command, rounds)
    else:
        block = {
            "benchmark": benchmark,
            "machine_class": "not recorded",
            "machine": f"{platform.processor() or 'CPU not known'}, {os.cpu_count()} cores",
            "cpu_flags": "not recorded",
            "date": datetime.date.today().isoformat(),
            "command": command,
            "rounds": rounds,
        }
    return {**block, "threads": thread_binding(meta)}
