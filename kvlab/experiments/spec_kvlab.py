"""kvlab's side of the speculative-decoding benchmark: one prefix-caching engine whose
speculation is swapped between runs, batch-1 runs of every configuration (each from an
empty prefix cache, its prefill inside its time, as the peers' runs), and the batch-size
sweep (see kvlab.experiments.speculative).

`repeats` > 1 runs every configuration that many times, in interleaved rounds (all
configurations once, then again in the other order), and keeps each one's fastest round:
on a shared machine a burst of other work then slows a round of every configuration, not
one configuration's only run. The counts (tokens, drafts, forwards) are the first
round's; greedy rounds repeat them exactly."""

from __future__ import annotations

import copy
import time

from kvlab.build import Engine
from kvlab.config import EngineConfig, SamplingParams, SpeculativeConfig
from kvlab.experiments.spec_runs import SpecRun, mark_identity
from kvlab.model.loading import LoadedModel
from kvlab.speculative.speculator import SpecStats, Speculator
from kvlab.units import round_up
from kvlab.workloads import Request


def prefix_engine(model: LoadedModel, requests: list[Request], copies: int = 2, **config) -> Engine:
    """A paged engine with hash prefix caching whose pool holds every request `copies`
    times over (so no prompt's cached blocks are evicted between runs); `config`: more
    EngineConfig fields (block_size, record_block_map, ...)."""
    longest = max(len(r.prompt) + r.max_new_tokens for r in requests)
    tokens = copies * sum(round_up(len(r.prompt) + r.max_new_tokens, 16) for r in requests)
    limit = model.config.max_position_embeddings
    return Engine(
        model,
        EngineConfig(
            cache="paged",
            prefix_caching="hash",
            max_model_len=min(round_up(longest + 16, 256), limit),
            kv_budget_tokens=tokens,
            **config,
        ),
    )


def set_speculation(engine: Engine, speculator: Speculator | None) -> None:
    """Swap the engine's speculative decoding between runs (nothing may be unfinished):
    one engine, and its prefix cache, serves every configuration."""
    if engine.has_unfinished():
        raise ValueError("set_speculation: the engine still has unfinished requests")
    engine.config.speculative = speculator.config if speculator else None
    engine.speculator = speculator


def kvlab_batch_run(
    engine: Engine, prompts: list[list[int]], max_new_tokens: list[int]
) -> tuple[list[list[int]], float, float, int]:
    """All `prompts` at once through `engine` -> (outputs, decode_s, wall_s, decode rows:
    the sequences in each decode step's forward, summed)."""
    first = len(engine.telemetry.records)
    params = [SamplingParams(max_new_tokens=n) for n in max_new_tokens]
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    wall = time.perf_counter() - start
    steps = [r for r in engine.telemetry.records[first:] if r.phase == "decode"]
    rows = sum(r.batch_seqs for r in steps)
    return [o.token_ids for o in outs], sum(r.step_s for r in steps), wall, rows


def run_kvlab(
    model: LoadedModel,
    workload: str,
    requests: list[Request],
    specs: dict[str, SpeculativeConfig | None],
    engine: Engine | None = None,
    warmup: bool = True,
    cold: bool = True,
    repeats: int = 1,
) -> tuple[list[SpecRun], float, Engine]:
    """Every config in `specs` on every request at batch 1 -> (runs, prefill_s, engine).

    cold: empty the prefix cache before each timed run, so its prefill is inside its
    wall_s, as HF's and vLLM's are (False: each prompt's K/V served from the cache, so
    wall_s is nearly all decoding; not comparable with the peers' speed-ups).
    repeats: rounds per request; each config's times are its fastest (module doc)."""
    engine = engine or prefix_engine(model, requests)
    speculators = {
        name: spec and Speculator(spec, engine.runner, engine.cache, engine.max_model_len)
        for name, spec in specs.items()
    }
    prompts = [list(r.prompt) for r in requests]
    max_new = [r.max_new_tokens for r in requests]
    set_speculation(engine, None)
    start = time.perf_counter()  # each prompt's prefill, then its K/V stay in the cache
    engine.generate(prompts, [SamplingParams(max_new_tokens=1)] * len(prompts))
    prefill_s = time.perf_counter() - start
    if warmup:  # first-call costs of every configuration land here, untimed
        for speculator in speculators.values():
            set_speculation(engine, speculator)
            engine.generate(prompts[:1], SamplingParams(max_new_tokens=4))
            if speculator:
                speculator.stats = SpecStats()
    names = list(specs)
    acc = {n: dict(outputs=[], decode_s=0.0, wall_s=0.0, forwards=0) for n in names}
    for i, (prompt, n) in enumerate(zip(prompts, max_new)):
        best: dict[str, tuple[float, float]] = {}  # name -> fastest (decode_s, wall_s)
        counted: dict[str, SpecStats] = {}  # name -> its stats after its first round
        for r in range(repeats):
            for name in names if (i + r) % 2 == 0 else names[::-1]:
                speculator = speculators[name]
                set_speculation(engine, speculator)
                if cold and not engine.cache.reset_prefix_cache():
                    raise RuntimeError("run_kvlab: the engine's prefix cache could not be emptied")
                outputs, decode_s, wall_s, rows = kvlab_batch_run(engine, [prompt], [n])
                if r == 0:
                    a = acc[name]
                    a["outputs"] += outputs
                    a["forwards"] += rows
                    if speculator:
                        counted[name] = copy.deepcopy(speculator.stats)
                    best[name] = (decode_s, wall_s)
                else:
                    best[name] = (min(best[name][0], decode_s), min(best[name][1], wall_s))
        for name, (decode_s, wall_s) in best.items():
            acc[name]["decode_s"] += decode_s
            acc[name]["wall_s"] += wall_s
            if name in counted:  # later rounds' drafts are not counted twice
                speculators[name].stats = counted[name]
    set_speculation(engine, None)
    runs = []
    for name, spec in specs.items():
        a, speculator = acc[name], speculators[name]
        stats = speculator.stats if speculator else None
        runs.append(
            SpecRun(
                workload,
                "kvlab",
                spec.method if spec else "none",
                spec.num_speculative_tokens if spec else 0,
                1,
                sum(map(len, a["outputs"])),
                sum(len(o) - 1 for o in a["outputs"]),
                a["forwards"],
                stats.drafted if stats else 0,
                stats.accepted if stats else 0,
                a["decode_s"],
                a["wall_s"],
                outputs=a["outputs"],
            )
        )
    return runs, prefill_s, engine


def batch_sweep(
    model: LoadedModel,
    workload: str,
    requests: list[Request],
    spec: SpeculativeConfig,
    batch_sizes: tuple[int, ...] = (1, 4, 16),
    engine: Engine | None = None,
    repeats: int = 1,
) -> list[SpecRun]:
    """Without and with `spec`, the requests cycled to each batch size and run at once.

    The prompts are prefilled into the prefix cache first (untimed), so the repeated
    prompts cost no prefill in either run; decode rows grow with the batch, and so does
    what verifying drafts costs. `repeats`: rounds of the pair (alternating which runs
    first); each keeps its fastest times and its first round's counts.
    """
    engine = engine or prefix_engine(model, requests)
    speculator = Speculator(spec, engine.runner, engine.cache, engine.max_model_len)
    set_speculation(engine, None)
    engine.generate([list(r.prompt) for r in requests], SamplingParams(max_new_tokens=1))
    runs = []
    for size in batch_sizes:
        chosen = [requests[i % len(requests)] for i in range(size)]
        prompts, max_new = [list(r.prompt) for r in chosen], [r.max_new_tokens for r in chosen]
        runs_of: dict[bool, SpecRun] = {}  # with speculation? -> its run
        for r in range(repeats):
            for sp in (None, speculator) if r % 2 == 0 else (speculator, None):
                set_speculation(engine, sp)
                before = copy.deepcopy(sp.stats) if sp else None
                outputs, decode_s, wall_s, rows = kvlab_batch_run(engine, prompts, max_new)
                drafted = sp.stats.drafted - before.drafted if sp else 0
                accepted = sp.stats.accepted - before.accepted if sp else 0
                tokens = sum(map(len, outputs))
                method, k = (spec.method, spec.num_speculative_tokens) if sp else ("none", 0)
                done = runs_of.get(sp is not None)
                if done is None:
                    runs_of[sp is not None] = SpecRun(
                        workload, "kvlab", method, k, size, tokens, tokens - size, rows,
                        drafted, accepted, decode_s, wall_s, outputs=outputs, part="batch",
                    )  # fmt: skip
                else:
                    done.decode_s = min(done.decode_s, decode_s)
                    done.wall_s = min(done.wall_s, wall_s)
        pair = [runs_of[False], runs_of[True]]
        mark_identity(pair)
        runs += pair
    set_speculation(engine, None)
    return runs
