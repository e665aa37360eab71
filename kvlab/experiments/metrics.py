"""The metrics of one engine run, from its per-step and per-request telemetry."""

from __future__ import annotations

import pandas as pd

# The metrics of one config, in the order `kvlab compare --json` prints them.
METRICS = (
    "peak_concurrent",  # most sequences running at once
    "reserved_bytes",  # peak KV bytes set aside for running sequences
    "live_bytes",  # peak KV bytes holding a token
    "waste_frac",  # sum of (reserved - live) / sum of reserved, over steps
    "waste_frac_at_peak",  # the same at the step of peak reserved bytes
    "prefix_hit_rate",  # prompt tokens served from the prefix cache / prompt tokens
    "preemptions",  # sequences preempted during the run
    "output_tokens",
    "wall_s",  # seconds of Engine.run
    "tok_s",  # output tokens / wall_s
    "ttft_p50_s",  # time to first token (from arrival), median
    "ttft_p95_s",
    "tpot_p50_s",  # time per output token after the first, median
    "budget_bytes",  # the KV budget every config got
)


def run_metrics(stats: pd.DataFrame, requests: pd.DataFrame, wall_s: float) -> dict:
    """The METRICS of one run from `engine.stats()` and `engine.request_stats()`."""
    reserved, waste = stats["reserved_bytes"], stats["waste_bytes"]
    peak = int(reserved.idxmax()) if len(stats) else None
    query, hit = stats["prefix_query_tokens"].sum(), stats["prefix_hit_tokens"].sum()
    preempted = stats.get("preemptions")  # cumulative, once the scheduler can preempt
    output_tokens = int(requests["output_tokens"].sum())
    ttft = requests["ttft_s"]
    tpot = requests.loc[requests["output_tokens"] > 1, "tpot_s"]
    at_peak = reserved[peak] if peak is not None else 0
    return {
        "peak_concurrent": int(stats["running"].max()),
        "reserved_bytes": int(reserved.max()),
        "live_bytes": int(stats["live_bytes"].max()),
        "waste_frac": round(float(waste.sum() / reserved.sum()), 4) if reserved.sum() else 0.0,
        "waste_frac_at_peak": round(float(waste[peak] / at_peak), 4) if at_peak else 0.0,
        "prefix_hit_rate": round(float(hit / query), 4) if query else 0.0,
        "preemptions": int(preempted.max()) if preempted is not None and len(stats) else 0,
        "output_tokens": output_tokens,
        "wall_s": round(wall_s, 3),
        "tok_s": round(output_tokens / wall_s, 2),
        "ttft_p50_s": round(float(ttft.quantile(0.5)), 4),
        "ttft_p95_s": round(float(ttft.quantile(0.95)), 4),
        "tpot_p50_s": round(float(tpot.quantile(0.5)), 4) if len(tpot) else 0.0,
        "budget_bytes": int(stats["budget_bytes"].max()),
    }
