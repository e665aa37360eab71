"""Colocated vs disaggregated serving under long-prompt interference, measured.

The trace: chat requests decode long answers while long doc-QA prompts arrive among them.
Colocated (one engine, with and without chunked prefill) each long prefill stalls every
running decode for its step; disaggregated (kvlab.disagg), a second process prefills and
the decode engine only admits the finished KV. On this 2-core CPU both processes share
the cores, so the prefill process still slows the decodes down: the figures show the
mechanism, not the gain on separate devices.

Each setup also reports `prefill_steps_s`: the wall time of the steps that prefilled in
the engines that decode, which every running decode waited for (none, disaggregated: its
prefills run in the other process, beside the decodes instead of between them).

With `decode_engines=(1, 2)` the disaggregated run is repeated with a pool of two decode
engines (1P:2D): the rows add what each decode engine was given and held. Both decode
engines share this process and its cores, taking turns to step, so the pool cannot raise
throughput here: it shows the routing and the smaller batch each engine runs.
"""

from __future__ import annotations

import statistics
import time

from kvlab import workloads
from kvlab.build import Engine
from kvlab.config import EngineConfig
from kvlab.disagg import Disaggregated
from kvlab.integrity import require
from kvlab.model.loading import LoadedModel
from kvlab.workloads import Request


def interference_trace(
    n_chat: int = 4,
    n_long: int = 2,
    chat_tokens: int = 48,
    long_tokens: int = 8,
    gap_s: float = 1.0,
    long_chars: int | None = None,
) -> list[Request]:
    """n_chat chat requests at 0 s, then n_long doc-QA prompts (~1700 tokens; the first
    `long_chars` characters if given) `gap_s` apart."""
    chats = [Request(r.prompt, chat_tokens) for r in workloads.uniform_chat(n_chat)]
    docs = [r.prompt[:long_chars] for r in workloads.doc_qa(n=n_long)]
    longs = [Request(doc, long_tokens, arrival_s=gap_s * (i + 1)) for i, doc in enumerate(docs)]
    return chats + longs


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p99": 0.0}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"p50": round(statistics.median(ordered), 4), "p99": round(p99, 4)}


def _summary(outputs, wall_s: float, engines: list[Engine]) -> dict:
    itl = [gap for o in outputs for gap in o.metrics.itl_s]
    tokens = sum(len(o.token_ids) for o in outputs)
    prefilled = 0.0
    for engine in engines:
        steps = engine.stats()
        prefilled += steps[steps["phase"] != "decode"]["step_s"].sum() if len(steps) else 0.0
    return {
        "ttft_s": _percentiles([o.metrics.ttft_s for o in outputs]),
        "itl_s": _percentiles(itl),
        "tokens_per_s": round(tokens / wall_s, 2),
        "wall_s": round(wall_s, 2),
        "prefill_steps_s": round(float(prefilled), 2),
    }


def _pool(pair: Disaggregated) -> dict:
    """What the pair moved (measured from its transfers) and how its decode engines were
    loaded: requests routed to each, the most sequences each held running after a step,
    and each one's mean decode batch."""
    stats = pair.stats
    peak, batch = [], []
    for engine in pair.decodes:
        steps = engine.stats()
        decodes = steps[steps["phase"] == "decode"]
        peak.append(int(steps["running"].max()) if len(steps) else 0)
        batch.append(round(float(decodes["batch_seqs"].mean()), 2) if len(decodes) else 0.0)
    return {
        "bytes_moved": stats.bytes_moved,
        "prompt_tokens_moved": stats.prompt_tokens,
        "transfers_rejected": stats.rejected,
        "prefill_engine_s": round(stats.prefill_s, 4),  # its steps' wall time, each once
        "prefill_engine_steps": stats.prefill_steps,
        "routed": list(stats.routed),
        "peak_running": peak,
        "mean_decode_batch": batch,
    }


def setup_name(decode_engines: int) -> str:
    """A disaggregated setup's row name: "disaggregated" (1P:1D), "disaggregated 1P:2D", ..."""
    return "disaggregated" if decode_engines == 1 else f"disaggregated 1P:{decode_engines}D"


def colocated_vs_disaggregated(
    model: LoadedModel, requests: list[Request], decode_engines: tuple[int, ...] = (1,), **config
) -> dict[str, dict]:
    """Colocated (without / with chunked prefill), then disaggregated with one prefill
    engine and each pool size in `decode_engines` (rows named by `setup_name`), one run
    each; the greedy tokens of all must be equal."""
    base = dict(cache="paged", block_size=16, max_num_batched_tokens=512) | config
    rows, tokens = {}, {}
    for name, extra in (("colocated", {}), ("colocated+chunked", {"chunked_prefill": True})):
        engine = Engine(model, EngineConfig(**base, **extra))
        start = time.perf_counter()
        outs = engine.run(requests, ignore_eos=True)
        rows[name] = _summary(outs, time.perf_counter() - start, [engine])
        tokens[name] = [o.token_ids for o in outs]
    for n in decode_engines:
        name = setup_name(n)
        pair = Disaggregated(model, EngineConfig(**base), EngineConfig(**base), decode_engines=n)
        try:
            start = time.perf_counter()
            outs = pair.run(requests, ignore_eos=True)
            rows[name] = _summary(outs, time.perf_counter() - start, pair.decodes)
        finally:
            pair.close()
        for engine in pair.decodes:  # no block left held on any engine after the run
            engine.cache.check_integrity()
            require(engine.cache.num_available == engine.cache.num_blocks, "a decode block leaked")
        require(pair.prefill_blocks_held == 0, "a prefill block leaked")
        tokens[name] = [o.token_ids for o in outs]
        rows[name] |= _pool(pair)
    first = tokens["colocated"]
    for name in rows:
        rows[name]["identical_to_colocated"] = tokens[name] == first
    return rows


def link_ms(nbytes: int, gbps: float) -> float:
    """Milliseconds `nbytes` take over a link of `gbps` GB/s (10^9 bytes per second)."""
    return nbytes / (gbps * 1e9) * 1e3
