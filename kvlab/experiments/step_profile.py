"""Where an engine step's time goes, part by part, and how far it is from its floor.

    steps = profile_steps(model, requests, config)  # one row per step, ms per part
    parts_table(steps)                               # decode steps: ms per step, share
    floor = decode_floor(model, steps)               # bytes / bandwidth, FLOPs / rate
    step_matmuls(model, rows=16)                     # the step's matmuls alone, per path

Each part is timed by wrapping what does it, on this engine only (the wrappers go when
the run ends); CPU work is synchronous, so wall clocks attribute it exactly (on CUDA the
times are launch times). The parts:

- schedule: the scheduler choosing the batch and securing its blocks (Python);
- metadata: positions, slot mappings and attention groups built for the step;
- kv write / kv gather: storing the new K/V in the pool, reading the context back;
- attention: scaled-dot-product attention over what was gathered;
- matmuls: every linear layer (QKV, O, gate/up, down, LM head); where a bf16 decode
  step's layers run in two native calls each (kvlab.kernels.cpu_layer), the time those
  calls count inside their matmuls;
- other forward: embedding, norms, RoPE, residual adds, SiLU;
- sampling: logits to tokens;
- bookkeeping: the rest of the step in Python (advancing sequences, finishing
  requests, telemetry).

The floor of a decode step on this machine is the larger of two measured quotients:
bytes it must read (every weight once, each sequence's K/V context) over the memory
bandwidth a large torch copy reaches, and its FLOPs over the rate a large matmul reaches.
A decode step's few rows reach far less than that rate, so the step's own matmuls are also
timed alone (`step_matmuls`): the fastest path there is the machine's rate for those shapes.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import pandas as pd
import torch

from kvlab.build import Engine
from kvlab.config import EngineConfig
from kvlab.model.loading import LoadedModel
from kvlab.workloads import Request

PARTS = (
    "schedule",
    "metadata",
    "kv write",
    "kv gather",
    "attention",
    "matmuls",
    "other forward",
    "sampling",
    "bookkeeping",
)


class _Clock:
    """Seconds spent inside each wrapped part during the current step, and the context
    the step's batch attends over."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = defaultdict(float)
        self.context_tokens = 0

    def wrap(self, part: str, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[part] += time.perf_counter() - start

        return timed

    def schedule(self, fn):
        """`fn` (the scheduler's schedule) timed, counting its batch's context before the
        batch runs: each row's computed tokens plus the ones it computes now."""
        timed = self.wrap("schedule", fn)

        def schedule(now):
            batch = timed(now)
            if batch is not None:
                self.context_tokens = sum(seq.num_computed + n for seq, n in batch)
            return batch

        return schedule


@contextmanager
def _instrumented(engine: Engine, clock: _Clock):
    """Wrap the parts of `engine`'s step with `clock`; unwrap on exit."""
    import kvlab.engine.core as core
    import kvlab.engine.postprocess as postprocess

    runner, pool = engine.runner, engine.cache.pool
    parts = {  # (owner, attribute) -> the part its time counts towards
        (pool, "write"): "kv write",
        (pool, "gather"): "kv gather",
        (runner, "attention_fn"): "attention+gather",
        (runner, "forward"): "forward",
        (runner, "linear"): "matmuls",
        (core, "build_attention_metadata"): "metadata",
        (postprocess, "sample"): "sampling",
    }
    saved = {key: getattr(*key) for key in [*parts, (engine.scheduler, "schedule")]}
    try:
        for (owner, name), part in parts.items():
            setattr(owner, name, clock.wrap(part, getattr(owner, name)))
        if getattr(runner, "layer_kernels", None) is not None:
            runner.forward = _native_matmuls(clock, runner.forward)
        engine.scheduler.schedule = clock.schedule(engine.scheduler.schedule)
        yield
    finally:
        for (owner, name), fn in saved.items():
            setattr(owner, name, fn)


def _native_matmuls(clock: _Clock, forward):
    """`forward`, adding to the step's matmuls the time the layer calls (kvlab.kernels.
    cpu_layer) count inside theirs."""
    from kvlab.kernels.cpu_layer import matmul_seconds

    def counted(*args, **kwargs):
        before = matmul_seconds()
        try:
            return forward(*args, **kwargs)
        finally:
            clock.spent["matmuls"] += matmul_seconds() - before

    return counted


def _parts(spent: dict[str, float], step_s: float) -> dict[str, float]:
    """Exclusive seconds per part of PARTS from the clock's inclusive ones."""
    attention = spent["attention+gather"] - spent["kv gather"]
    inside = spent["kv write"] + spent["kv gather"] + attention + spent["matmuls"]
    forward = spent["forward"]
    parts = {
        "schedule": spent["schedule"],
        "metadata": spent["metadata"],
        "kv write": spent["kv write"],
        "kv gather": spent["kv gather"],
        "attention": attention,
        "matmuls": spent["matmuls"],
        "other forward": max(forward - inside, 0.0),
        "sampling": spent["sampling"],
    }
    parts["bookkeeping"] = max(step_s - sum(parts.values()), 0.0)
    return parts


def profile_steps(
    model: LoadedModel,
    requests: list[Request],
    config: EngineConfig,
    ignore_eos: bool = True,
    progress: bool = False,
) -> pd.DataFrame:
    """Serve `requests` on one engine, timing each part of every step.

    Returns one row per step: step, phase, batch_seqs, tokens, context_tokens (K/V
    tokens the step's sequences attend over), step_ms, and one `<part> ms` column per
    part of PARTS (they sum to step_ms).
    """
    engine = Engine(model, config)
    clock = _Clock()
    rows = []
    start = 0.0

    def step_starts() -> None:
        nonlocal start
        clock.spent.clear()
        start = time.perf_counter()

    def step_ends(finished) -> None:
        step_s = time.perf_counter() - start
        if engine.telemetry.records and clock.spent["forward"] > 0:
            record = engine.telemetry.records[-1]
            parts = _parts(clock.spent, step_s)
            rows.append(
                {
                    "step": record.step,
                    "phase": record.phase,
                    "batch_seqs": record.batch_seqs,
                    "tokens": record.tokens,
                    "context_tokens": clock.context_tokens,
                    "step_ms": 1e3 * step_s,
                    **{f"{part} ms": 1e3 * parts[part] for part in PARTS},
                }
            )

    engine.observers.subscribe("before_schedule", step_starts)
    engine.observers.subscribe("after_step", step_ends)
    try:
        with _instrumented(engine, clock):
            engine.run(requests, ignore_eos=ignore_eos, progress=progress)
    finally:
        engine.close()
    return pd.DataFrame(rows)


def parts_table(steps: pd.DataFrame, phase: str = "decode") -> pd.DataFrame:
    """Mean ms per `phase` step of each part, and its share of the step (%)."""
    chosen = steps[steps["phase"] == phase]
    if chosen.empty:
        raise ValueError(f"no {phase} steps in the profile (phases: {set(steps['phase'])})")
    ms = pd.Series({part: chosen[f"{part} ms"].mean() for part in PARTS})
    table = pd.DataFrame({"ms per step": ms, "share %": 100 * ms / ms.sum()})
    table.loc["step"] = [chosen["step_ms"].mean(), 100.0]
    return table


# --- the floor ---------------------------------------------------------------------
@dataclass
class MachineRates:
    """What this machine reaches in torch: copy bandwidth and matmul rate."""

    bandwidth_gb_s: float  # bytes read + written per second by a large copy, / 1e9
    matmul_gflop_s: float  # 2 n^3 / seconds of an n x n matmul, / 1e9
    dtype: str
    threads: int

    @classmethod
    def measure(
        cls, dtype: torch.dtype = torch.float32, mib: int = 256, n: int = 1024, repeats: int = 5
    ) -> MachineRates:
        """The best of `repeats` timings of a `mib` MiB copy and an n x n matmul."""
        source = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
        target = torch.empty_like(source)
        copy_s = _best(lambda: target.copy_(source), repeats)
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        matmul_s = _best(lambda: a @ b, repeats)
        return cls(
            bandwidth_gb_s=2 * source.nbytes / copy_s / 1e9,
            matmul_gflop_s=2 * n**3 / matmul_s / 1e9,
            dtype=str(dtype).removeprefix("torch."),
            threads=torch.get_num_threads(),
        )


def _best(fn, repeats: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


@dataclass
class DecodeFloor:
    """The least time a mean decode step of the profile can take on this machine."""

    batch_seqs: float  # mean sequences per decode step
    weight_bytes: int  # every linear weight, read once per step
    kv_bytes: float  # mean K/V bytes of the context read per step
    gflop: float  # mean FLOPs per step / 1e9
    bandwidth_ms: float  # (weight + kv bytes) / bandwidth
    compute_ms: float  # FLOPs / matmul rate
    rates: MachineRates
    matmuls_alone_ms: dict[str, float] = field(default_factory=dict)  # step_matmuls: path -> ms
    matmul_gflop: float = 0.0  # the linears' FLOPs on the step's mean rows (rounded) / 1e9

    @property
    def matmuls_best_ms(self) -> float | None:
        """The fastest this machine runs the step's matmuls alone (its rate for the step's
        own shapes), or None when they were not timed."""
        return min(self.matmuls_alone_ms.values()) if self.matmuls_alone_ms else None

    @property
    def floor_ms(self) -> float:
        return max(self.bandwidth_ms, self.compute_ms)

    def to_json(self) -> dict:
        return asdict(self) | {"floor_ms": self.floor_ms, "matmuls_best_ms": self.matmuls_best_ms}


def step_matmuls(model: LoadedModel, rows: int, repeats: int = 3) -> dict[str, float]:
    """ms of one decode step's matmuls alone: every linear weight of the model once, on
    `rows` rows, back to back as a step runs them (each weight read from memory, not a
    cache), best of `repeats`, through each path this machine has: torch's F.linear,
    kvlab's oneDNN linears (kvlab.model.linear.Linears) and, for bf16 where the tile unit
    runs, its AMX linears (AmxLinears), for fp32 where it pays, its stream (StreamLinears)."""
    import torch.nn.functional as F

    from kvlab.model.linear import AmxLinears, StreamLinears
    from kvlab.model.runner import ModelRunner

    runner = ModelRunner(model.hf_model)
    weights = runner.matmul_weights(runner.layers)
    paths = {"F.linear": F.linear, "oneDNN": runner.linear}
    fused = ModelRunner(model.hf_model, fused_ops=True).linear
    if isinstance(fused, AmxLinears):
        paths["AMX"] = fused
    elif isinstance(fused, StreamLinears):
        paths["stream"] = fused
    rows = max(1, int(rows))
    inputs = {k: torch.randn(rows, k).to(runner.dtype) for k in {w.shape[1] for w in weights}}
    with torch.inference_mode():
        return {
            name: 1e3 * _best(lambda f=f: [f(inputs[w.shape[1]], w) for w in weights], repeats)
            for name, f in paths.items()
        }


def decode_floor(
    model: LoadedModel,
    steps: pd.DataFrame,
    rates: MachineRates | None = None,
    time_matmuls: bool = False,
) -> DecodeFloor:
    """The decode floor of `steps` (profile_steps' decode rows) on this machine;
    `time_matmuls`: also time the step's matmuls alone on its mean rows (step_matmuls)."""
    from kvlab.cache.codecs import CODECS
    from kvlab.model.runner import ModelRunner

    decode = steps[steps["phase"] == "decode"]
    if decode.empty:
        raise ValueError("no decode steps in the profile")
    runner = ModelRunner(model.hf_model)
    rates = rates or MachineRates.measure(runner.dtype)
    linear = [runner.lm_head] + [
        w for layer in runner.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)
    ]
    weight_bytes = sum(w.numel() * w.element_size() for w in linear)
    weight_params = sum(w.numel() for w in linear)
    token_bytes = CODECS[None].token_bytes(runner.kv_spec, runner.dtype)  # every layer, K + V
    batch, context = decode["batch_seqs"].mean(), decode["context_tokens"].mean()
    kv_bytes = context * token_bytes
    spec = runner.kv_spec
    # QK^T and PV: 2 FLOPs per multiply-add, per query head, per context token, per layer.
    attention_flop = 4 * context * runner.num_heads * spec.head_dim * spec.num_layers
    flop = 2 * batch * weight_params + attention_flop
    return DecodeFloor(
        batch_seqs=float(batch),
        weight_bytes=weight_bytes,
        kv_bytes=float(kv_bytes),
        gflop=flop / 1e9,
        bandwidth_ms=1e3 * (weight_bytes + kv_bytes) / (rates.bandwidth_gb_s * 1e9),
        compute_ms=1e3 * flop / (rates.matmul_gflop_s * 1e9),
        rates=rates,
        matmuls_alone_ms=step_matmuls(model, round(batch)) if time_matmuls else {},
        matmul_gflop=2 * max(1, round(batch)) * weight_params / 1e9,
    )
