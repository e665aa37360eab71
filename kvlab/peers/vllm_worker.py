"""vLLM's offline engine, driven by kvlab: a worker run by the vLLM venv's python.

    .venv-vllm/bin/python kvlab/peers/vllm_worker.py LOG_FILE

It never imports kvlab (vLLM pins a transformers that kvlab's venv cannot have); kvlab's
side is kvlab.peers.vllm_peer. Commands arrive one JSON object a line on stdin,
each answer leaves as one JSON line on stdout; everything vLLM prints goes to LOG_FILE.

    {"cmd": "start", "engine": {EngineArgs fields}}
        -> {"vllm_version", "load_s", "num_blocks", "block_size", "logged_kv_tokens",
            "omp_core_ids", "enforce_eager", "compilation_mode", "log_stats"}
    {"cmd": "run", "prompts": [{"token_ids": [...], "max_tokens": n}, ...],
     "arrival": "together" | "one-by-one", "reset_prefix_cache": true, "profile": false}
        -> {"run_s", "cpu_s", "steps", "peak_running", "peak_waiting", "preemptions",
            "prefix_queries", "prefix_hits", "drafts", "drafted", "accepted",
            "step_rows": [{"step_ms", "running", "prompt_tokens", "generation_tokens"}, ...],
            "ops": [{"op", "calls", "self_ms"}, ...],
            "outputs": [{"token_ids", "num_cached_tokens", "num_preemptions"}, ...]}
    {"cmd": "stop"}  -> {} (the engine shuts down; a new "start" may follow)
A failed command answers {"error": "...", "traceback": "..."}; end of input ends the worker.

The engine gets vLLM's own defaults for every field the command leaves out: on the CPU
build that is the model compiled once by torch.compile/inductor (DYNAMO_TRACE_ONCE, during
"start", so load_s holds the compile) and block size 128; "enforce_eager": true in the
command runs it eagerly. "start" answers with what vLLM chose (enforce_eager, the
compilation mode's name, block_size).

Stats logging is off, as `vllm.LLM` runs (`disable_log_stats=True`), unless the command's
engine arguments say "disable_log_stats": false: timed runs leave it off. With it on, peak
running requests and preemptions come from a stat logger that vLLM calls once per engine
step (SchedulerStats, IterationStats), and with a `speculative_config` engine argument,
drafted and accepted tokens from SchedulerStats.spec_decoding_stats; with it off they are
0. A request's prefix-hit tokens come from RequestOutput.num_cached_tokens either way.

Greedy (temperature 0), EOS ignored (every request makes exactly max_tokens), so the
answers compare token for token with kvlab's. Each step's wall time and (with stats on)
the prompt and generated tokens it completed make `step_rows`; with "profile" (an engine
in this process: VLLM_ENABLE_V1_MULTIPROCESSING=0) torch's profiler records the run and
`ops` holds the operators that took the most CPU time (self time, not counting the ops
they call).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import traceback

# Run as a script, this file's folder (kvlab/peers) heads sys.path: drop it, so
# kvlab's modules never shadow one that vLLM imports.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

STEPS: list[dict] = []  # one row per engine step, from StepLogger
FINISHED: dict[str, int] = {}  # request id -> preemptions, from StepLogger


def step_logger_class():
    """A vLLM stat logger that keeps one row per engine step (in this process)."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class StepLogger(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0):
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
            row = {}
            if scheduler_stats is not None:
                cache = scheduler_stats.prefix_cache_stats
                row.update(
                    running=scheduler_stats.num_running_reqs,
                    waiting=scheduler_stats.num_waiting_reqs,
                    queries=cache.queries,
                    hits=cache.hits,
                )
                spec = scheduler_stats.spec_decoding_stats  # None without speculation
                if spec is not None:
                    row.update(drafts=spec.num_drafts, drafted=spec.num_draft_tokens,
                               accepted=spec.num_accepted_tokens)  # fmt: skip
            if iteration_stats is not None:
                row["preempted"] = iteration_stats.num_preempted_reqs
                row["prompt_tokens"] = iteration_stats.num_prompt_tokens
                row["generation_tokens"] = iteration_stats.num_generation_tokens
                for done in iteration_stats.finished_requests:
                    FINISHED[done.request_id.split("-")[0]] = done.num_preemptions
            STEPS.append(row)

        def log_engine_initialized(self):
            pass

    return StepLogger


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and its live children (engine core,
    model worker in vLLM's multiprocess mode)."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            times = proc.cpu_times()
            total += times.user + times.system
        except psutil.Error:
            pass
    return total


def engine_arguments(engine_args: dict) -> dict:
    """EngineArgs fields: the command's, over seed 0 and stats logging off (`vllm.LLM`'s
    default); vLLM's defaults for the rest (compiled, its platform's block size: nothing
    is forced eager here)."""
    return {"disable_log_stats": True, "seed": 0, **engine_args}


def start(engine_args: dict, log_file: str) -> tuple[object, dict]:
    import vllm
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    args = engine_arguments(engine_args)
    logged_from = os.path.getsize(log_file)
    began = time.perf_counter()
    log_stats = not args["disable_log_stats"]
    loggers = [step_logger_class()] if log_stats else None  # per-step counts need stats
    engine = LLMEngine.from_engine_args(EngineArgs(**args), stat_loggers=loggers)
    load_s = time.perf_counter() - began
    sys.stdout.flush()
    sys.stderr.flush()
    with open(log_file, encoding="utf-8", errors="replace") as log:
        log.seek(logged_from)
        text = log.read()
    size = re.search(r"KV cache size: ([\d,]+) tokens", text)
    cores = re.search(r"core ids=\[([\d, ]*)\]", text)
    cache = engine.vllm_config.cache_config
    mode = engine.vllm_config.compilation_config.mode
    return engine, {
        "vllm_version": vllm.__version__,
        "load_s": load_s,
        "num_blocks": cache.num_gpu_blocks,
        "block_size": cache.block_size,
        "logged_kv_tokens": int(size.group(1).replace(",", "")) if size else None,
        "omp_core_ids": [int(c) for c in cores.group(1).split(",") if c.strip()] if cores else None,
        "enforce_eager": bool(engine.vllm_config.model_config.enforce_eager),
        "compilation_mode": getattr(mode, "name", str(mode)),  # NONE when eager
        "log_stats": log_stats,
    }


TOP_OPS = 40  # operators kept from a profile, by self CPU time
STEP_KEYS = ("running", "prompt_tokens", "generation_tokens")  # kept per step


def profiled(enabled: bool):
    """torch's CPU profiler where `enabled` (the engine must run in this process), else a
    context that records nothing."""
    import contextlib

    if not enabled:
        return contextlib.nullcontext()
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        raise ValueError(
            "profile needs the engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)"
        )
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU])


def top_ops(prof) -> list[dict]:
    """The profile's operators by self CPU time, most first."""
    if prof is None:
        return []
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    return [
        {"op": e.key, "calls": e.count, "self_ms": e.self_cpu_time_total / 1e3}
        for e in events[:TOP_OPS]
    ]


def run(
    engine, prompts: list[dict], arrival: str, reset_prefix_cache: bool, profile: bool = False
) -> dict:
    from vllm import SamplingParams

    if arrival not in ("together", "one-by-one"):
        raise ValueError(f"arrival={arrival!r}: give 'together' or 'one-by-one'")
    if reset_prefix_cache and not engine.reset_prefix_cache():
        raise RuntimeError("vLLM could not reset its prefix cache")
    every = list(range(len(prompts)))
    groups = [every] if arrival == "together" else [[i] for i in every]
    first_step, outputs, steps = len(STEPS), {}, 0
    FINISHED.clear()
    step_rows = []
    cpu0, began = cpu_seconds(), time.perf_counter()
    with profiled(profile) as prof:
        for group in groups:
            for i in group:
                params = SamplingParams(
                    max_tokens=int(prompts[i]["max_tokens"]), temperature=0.0, ignore_eos=True
                )
                ids = list(prompts[i]["token_ids"])
                engine.add_request(f"r{i}", {"prompt_token_ids": ids}, params)
            while engine.has_unfinished_requests():
                steps += 1
                logged, step_began = len(STEPS), time.perf_counter()
                for out in engine.step():
                    if out.finished:  # vLLM appends "-<random>" to the ids it is given
                        outputs[int(out.request_id.split("-")[0][1:])] = out
                ms = 1e3 * (time.perf_counter() - step_began)
                row = STEPS[-1] if len(STEPS) > logged else {}  # what vLLM logged for it
                step_rows.append({"step_ms": ms, **{k: row.get(k, 0) for k in STEP_KEYS}})
    run_s, cpu_s = time.perf_counter() - began, cpu_seconds() - cpu0
    rows = STEPS[first_step:]
    return {
        "run_s": run_s,
        "cpu_s": cpu_s,
        "steps": steps,
        "peak_running": max((r.get("running", 0) for r in rows), default=0),
        "peak_waiting": max((r.get("waiting", 0) for r in rows), default=0),
        "preemptions": sum(r.get("preempted", 0) for r in rows),
        "prefix_queries": sum(r.get("queries", 0) for r in rows),
        "prefix_hits": sum(r.get("hits", 0) for r in rows),
        "drafts": sum(r.get("drafts", 0) for r in rows),  # speculative verifications
        "drafted": sum(r.get("drafted", 0) for r in rows),
        "accepted": sum(r.get("accepted", 0) for r in rows),
        "step_rows": step_rows,
        "ops": top_ops(prof),
        "outputs": [
            {
                "token_ids": list(outputs[i].outputs[0].token_ids),
                "num_cached_tokens": outputs[i].num_cached_tokens,
                "num_preemptions": FINISHED.get(f"r{i}", 0),
            }
            for i in range(len(prompts))
        ],
    }


def serve(log_file: str) -> int:
    """Answer commands from stdin until it ends; vLLM's own output goes to log_file."""
    answers = os.fdopen(os.dup(1), "w", encoding="utf-8")  # the pipe kvlab reads
    log = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)  # vLLM's prints and its child processes' go to the log
    os.dup2(log, 2)
    os.close(log)
    engine = None
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            command = json.loads(line)
            kind = command.get("cmd")
            if kind == "start":
                if engine is not None:
                    raise RuntimeError("an engine is running: send 'stop' first")
                engine, answer = start(command["engine"], log_file)
            elif kind == "run":
                if engine is None:
                    raise RuntimeError("no engine: send 'start' first")
                answer = run(
                    engine,
                    command["prompts"],
                    command.get("arrival", "together"),
                    bool(command.get("reset_prefix_cache", True)),
                    bool(command.get("profile", False)),
                )
            elif kind == "stop":
                if engine is not None:
                    engine.engine_core.shutdown()
                engine, answer = None, {}
            else:
                raise ValueError(f"unknown command {kind!r}: give start, run or stop")
        except Exception as err:  # answered, so kvlab can raise it with the log's tail
            answer = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()
    if engine is not None:
        engine.engine_core.shutdown()
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(serve(sys.argv[1]))
