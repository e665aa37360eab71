"""One workload through several engine designs, on the same model and the same KV budget.

    result = compare(model, doc_qa(16), ["naive", "paged", "paged+prefix", "paged+prefix+int8"])
    result.table()                      # one row per config
    result.to_json()                    # {"configs": {name: {metric: value}}}
    comparison_figures(result)["memory"].show()   # kvlab.viz.compare: reserved vs live KV

A config name is a cache kind followed by "+"-separated options (`parse_config`):
"naive", "paged", "paged+prefix" (hash prefix caching, as vLLM), "paged+radix" (radix
tree, as SGLang), a KV codec ("paged+prefix+int8", "paged+kivi2"), "chunked" (chunked
prefill), "watermark" (watermark admission, with preemption), "swap" (swap preemption),
"static" (static batching) and "bsN" (block size N).

The budget is in **bytes**, so a quantized KV codec buys more token slots with it.
Every request produces exactly its max_new_tokens by default (ignore_eos), so every
config serves the same number of tokens.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import pandas as pd
from tqdm.auto import tqdm

from kvlab.build import Engine
from kvlab.config import EngineConfig
from kvlab.experiments.metrics import run_metrics
from kvlab.model.loading import LoadedModel
from kvlab.presets import (
    DEFAULT_CONFIGS,
    default_max_model_len,
    model_bytes_per_token,
    parse_config,
)
from kvlab.workloads import Request, encode_requests


@dataclass
class ConfigRun:
    """One config's run: its metrics, the per-step telemetry and the per-request rows."""

    name: str
    config: EngineConfig
    metrics: dict
    stats: pd.DataFrame = field(repr=False)
    requests: pd.DataFrame = field(repr=False)
    outputs: list[list[int]] = field(repr=False, default_factory=list)


@dataclass
class Comparison:
    workload: str
    budget_bytes: int
    max_model_len: int
    runs: dict[str, ConfigRun]

    def to_json(self) -> dict:
        """{"configs": {name: {metric: value}}} (METRICS, in order)."""
        return {"configs": {name: dict(run.metrics) for name, run in self.runs.items()}}

    def table(self) -> pd.DataFrame:
        """One row per config, one column per metric."""
        return pd.DataFrame.from_dict(self.to_json()["configs"], orient="index")

    def stats(self) -> dict[str, pd.DataFrame]:
        """The per-step telemetry of every config, by name (for plotting)."""
        return {name: run.stats for name, run in self.runs.items()}


def compare(
    model: LoadedModel,
    requests: list[Request],
    configs: list[str] | tuple[str, ...] = DEFAULT_CONFIGS,
    budget_bytes: int | None = None,
    max_model_len: int | None = None,
    block_size: int = 16,
    ignore_eos: bool = True,
    progress: bool = False,
    workload: str = "custom",
    **engine_options,
) -> Comparison:
    """Serve `requests` once per config with the same KV budget; collect metrics and stats.

    Args:
        budget_bytes: KV budget of every config; default four naive sequences of
            max_model_len in the model's dtype.
        max_model_len: default: the longest request rounded up to 256 tokens (what the
            naive cache reserves per sequence).
        engine_options: further EngineConfig fields for every config (e.g. max_num_seqs).
    """
    if not requests:
        raise ValueError("the workload has no requests")
    configs = list(configs)
    if not configs or len(set(configs)) != len(configs):
        raise ValueError(f"configs={configs}: give at least one, each once")
    requests = encode_requests(model, requests)
    max_model_len = max_model_len or default_max_model_len(model, requests)
    if budget_bytes is None:
        budget_bytes = 4 * max_model_len * model_bytes_per_token(model)
    base = dict(
        kv_budget_bytes=budget_bytes,
        max_model_len=max_model_len,
        block_size=block_size,
        **engine_options,
    )
    parsed = {name: parse_config(name, **base) for name in configs}  # fail before running
    runs = {}
    for name, config in parsed.items():
        if progress:
            tqdm.write(f"kvlab compare: {name}", file=sys.stderr)
        engine = Engine(model, config)
        start = time.perf_counter()
        outputs = engine.run(requests, ignore_eos=ignore_eos, progress=progress)
        wall = time.perf_counter() - start
        stats, per_request = engine.stats(), engine.request_stats()
        runs[name] = ConfigRun(
            name,
            config,
            run_metrics(stats, per_request, wall),
            stats,
            per_request,
            [o.token_ids for o in outputs],
        )
        del engine
    return Comparison(workload, budget_bytes, max_model_len, runs)
