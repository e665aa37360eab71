"""One workload through several engine designs, on the same model and the same KV budget.

    result = compare(model, doc_qa(16), ["naive", "paged", "paged+prefix", "paged+prefix+int8"])
    result.table()                      # one row per config
    result.to_json()                    # {"configs": {name: {metric: value}}}
    result.figures()["memory"].show()   # reserved vs live KV over time, per config

A config name is a cache kind followed by "+"-separated options (`parse_config`):
"naive", "paged", "paged+prefix" (hash prefix caching, as vLLM), "paged+radix" (radix
tree, as SGLang), a KV dtype ("paged+prefix+int8", "paged+kivi2"), "chunked" (chunked
prefill), "watermark" (watermark admission, with preemption), "swap" (swap preemption),
"static" (static batching) and "bsN" (block size N).

The budget is in **bytes**, so a quantized KV dtype buys more token slots with it.
Every request produces exactly its max_new_tokens by default (ignore_eos), so every
config serves the same number of tokens.
"""

from __future__ import annotations

import html
import re
import sys
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots
from tqdm.auto import tqdm

from kvlab.config import CACHE_KINDS, KV_DTYPES, EngineConfig
from kvlab.engine import Engine
from kvlab.model_loading import LoadedModel
from kvlab.planner import ModelShape, kv_bytes_per_token, parse_size
from kvlab.workloads import Request

DEFAULT_CONFIGS = ("naive", "paged", "paged+prefix", "paged+prefix+int8")
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
MIB = 2**20
PALETTE = qualitative.Plotly
PEER_COLOR = "#9e9e9e"

# "+option" -> EngineConfig fields it sets.
_OPTIONS: dict[str, dict[str, object]] = {
    "prefix": {"prefix_caching": "hash"},
    "hash": {"prefix_caching": "hash"},
    "radix": {"prefix_caching": "radix"},
    "chunked": {"chunked_prefill": True},
    "watermark": {"admission": "watermark"},
    "swap": {"preemption": "swap"},
    "static": {"batching": "static"},
    **{dtype: {"kv_dtype": dtype} for dtype in KV_DTYPES},
}


def parse_config(name: str, **base) -> EngineConfig:
    """The EngineConfig a config name spells ("paged+prefix+int8"), on top of `base` fields.

    Raises ValueError naming the unknown part and the parts that are known.
    """
    cache, *parts = name.strip().split("+")
    if cache not in CACHE_KINDS:
        raise ValueError(f"config {name!r} must start with a cache kind, one of {CACHE_KINDS}")
    known = {f.name for f in fields(EngineConfig)}
    options: dict[str, object] = {"cache": cache}
    for part in parts:
        block = re.fullmatch(r"bs(\d+)", part)
        if block:
            options["block_size"] = int(block.group(1))
        elif part in _OPTIONS:
            missing = set(_OPTIONS[part]) - known
            if missing:
                raise ValueError(f"config {name!r}: this kvlab's EngineConfig has no {missing}")
            options.update(_OPTIONS[part])
        else:
            raise ValueError(
                f"config {name!r}: unknown option {part!r}; options are {sorted(_OPTIONS)} "
                "and bsN (block size N)"
            )
    return EngineConfig(**{**base, **options})


def prompt_ids(tokenizer, prompt: str | list[int]) -> list[int]:
    """Token ids of a prompt as kvlab's engine encodes it (chat template for text)."""
    if not isinstance(prompt, str):
        return [int(t) for t in prompt]
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": prompt}]
        return list(
            tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
    return list(tokenizer.encode(prompt))


def encode_requests(model: LoadedModel, requests: list[Request]) -> list[Request]:
    """The same requests with token-id prompts, so every system sees identical tokens."""
    return [replace(r, prompt=prompt_ids(model.tokenizer, r.prompt)) for r in requests]


def model_bytes_per_token(model: LoadedModel) -> int:
    """KV bytes per token of the model in its own dtype (kv_dtype None)."""
    names = {"torch.float32": "fp32", "torch.float16": "fp16", "torch.bfloat16": "bf16"}
    return kv_bytes_per_token(ModelShape.from_config(model.config), names[str(model.dtype)])


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def default_max_model_len(model: LoadedModel, requests: list[Request]) -> int:
    """The longest request (token-id prompt + max_new_tokens), rounded up to 256."""
    longest = max(len(r.prompt) + r.max_new_tokens for r in requests)
    return min(round_up(longest, 256), model.config.max_position_embeddings)


def parse_budget(text: str | int, bytes_per_token: int) -> int:
    """A KV budget in bytes from "64MiB", "200MB", a byte count, or "4096tok" (tokens at
    `bytes_per_token`, the model's own dtype)."""
    if isinstance(text, str):
        tokens = re.fullmatch(r"\s*(\d+)\s*(tok|tokens)\s*", text)
        if tokens:
            return int(tokens.group(1)) * bytes_per_token
    return parse_size(text)


def summarize(stats: pd.DataFrame, requests: pd.DataFrame, wall_s: float) -> dict:
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

    def figures(self, peers: dict[str, float] | None = None) -> dict[str, go.Figure]:
        """Standalone figures: memory over time, capacity, throughput and latency.

        `peers`: extra throughput bars {name: tok/s} (e.g. from a saved bench), grey.
        """
        figs = {
            "memory": memory_figure(self),
            "capacity": _single(add_capacity, self, "Peak concurrent sequences and waste"),
            "throughput": _single(add_throughput, self, "Throughput", peers),
            "latency": _single(add_latency, self, "Latency"),
        }
        return figs

    def write_html(self, path: str | Path, peers: dict[str, float] | None = None) -> None:
        """A self-contained HTML report: the metrics table and every figure."""
        title = f"kvlab compare: {self.workload}"
        note = (
            f"KV budget {self.budget_bytes / MIB:.1f} MiB for every config, "
            f"max_model_len {self.max_model_len}."
        )
        write_report(path, title, note, {"metrics": self.table()}, self.figures(peers))


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
            summarize(stats, per_request, wall),
            stats,
            per_request,
            [o.token_ids for o in outputs],
        )
        del engine
    return Comparison(workload, budget_bytes, max_model_len, runs)


# --- figures ---------------------------------------------------------------------------------
# Each add_* draws into a figure cell, so the same traces serve the standalone figures
# and the dashboard's subplot grid.


def _single(add, comparison: Comparison, title: str, *args) -> go.Figure:
    fig = go.Figure()
    add(fig, comparison, *args)
    fig.update_layout(title=title, height=380, barmode="group")
    return fig


def _cell(row: int | None, col: int | None) -> dict:
    return {} if row is None else {"row": row, "col": col}


def add_memory(fig: go.Figure, comparison: Comparison, row=None, col=None) -> None:
    """Reserved (solid) and live (dotted) KV MiB against seconds, a colour per config,
    and the budget (dashed)."""
    cell, end = _cell(row, col), 0.0
    for i, (name, run) in enumerate(comparison.runs.items()):
        color, stats = PALETTE[i % len(PALETTE)], run.stats
        end = max(end, float(stats["time_s"].max() - stats["time_s"].min()) if len(stats) else 0)
        t = stats["time_s"] - stats["time_s"].min()
        for column, dash, label in (
            ("reserved_bytes", "solid", "reserved"),
            ("live_bytes", "dot", "live"),
        ):
            fig.add_scatter(
                x=t,
                y=stats[column] / MIB,
                name=f"{name} {label}",
                legendgroup=name,
                line=dict(color=color, dash=dash),
                **cell,
            )
    budget = comparison.budget_bytes / MIB
    fig.add_scatter(
        x=[0, end],
        y=[budget, budget],
        name="KV budget",
        mode="lines",
        line=dict(color="black", dash="dash", width=1),
        **cell,
    )
    fig.update_xaxes(title_text="seconds", **cell)
    fig.update_yaxes(title_text="KV MiB", rangemode="tozero", **cell)


def memory_figure(comparison: Comparison) -> go.Figure:
    """KV memory over time (top) and running sequences (bottom), a colour per config."""
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.65, 0.35])
    add_memory(fig, comparison, 1, 1)
    for i, (name, run) in enumerate(comparison.runs.items()):
        stats = run.stats
        fig.add_scatter(
            x=stats["time_s"] - stats["time_s"].min(),
            y=stats["running"],
            name=f"{name} running",
            legendgroup=name,
            showlegend=False,
            line=dict(color=PALETTE[i % len(PALETTE)], shape="hv"),
            row=2,
            col=1,
        )
    fig.update_yaxes(title_text="running", rangemode="tozero", row=2, col=1)
    fig.update_layout(height=560, title="KV memory: reserved (solid) vs live (dotted)")
    return fig


def add_capacity(fig: go.Figure, comparison: Comparison, row=None, col=None) -> None:
    """Peak concurrent sequences per config, labelled with the waste fraction."""
    names = list(comparison.runs)
    metrics = [comparison.runs[n].metrics for n in names]
    fig.add_bar(
        x=names,
        y=[m["peak_concurrent"] for m in metrics],
        text=[f"waste {100 * m['waste_frac']:.0f}%" for m in metrics],
        marker_color=[PALETTE[i % len(PALETTE)] for i in range(len(names))],
        name="peak concurrent",
        showlegend=False,
        **_cell(row, col),
    )
    fig.update_yaxes(title_text="peak sequences", **_cell(row, col))


def add_throughput(
    fig: go.Figure,
    comparison: Comparison,
    peers: dict[str, float] | None = None,
    row=None,
    col=None,
) -> None:
    """Output tok/s per config (coloured) and per peer (grey)."""
    names = list(comparison.runs)
    fig.add_bar(
        x=names,
        y=[comparison.runs[n].metrics["tok_s"] for n in names],
        marker_color=[PALETTE[i % len(PALETTE)] for i in range(len(names))],
        name="kvlab",
        showlegend=False,
        **_cell(row, col),
    )
    if peers:
        fig.add_bar(
            x=list(peers),
            y=list(peers.values()),
            marker_color=PEER_COLOR,
            name="bench",
            showlegend=False,
            **_cell(row, col),
        )
    fig.update_yaxes(title_text="output tok/s", **_cell(row, col))


def add_latency(fig: go.Figure, comparison: Comparison, row=None, col=None) -> None:
    """TTFT p50 / p95 and TPOT p50 per config, in seconds (grouped bars)."""
    names = list(comparison.runs)
    for key, label, color in (
        ("ttft_p50_s", "TTFT p50", "#636efa"),
        ("ttft_p95_s", "TTFT p95", "#ab63fa"),
        ("tpot_p50_s", "TPOT p50", "#ffa15a"),
    ):
        fig.add_bar(
            x=names,
            y=[comparison.runs[n].metrics[key] for n in names],
            name=label,
            legendgroup="latency",
            marker_color=color,
            **_cell(row, col),
        )
    fig.update_yaxes(title_text="seconds", **_cell(row, col))


def write_report(
    path: str | Path,
    title: str,
    note: str,
    tables: dict[str, pd.DataFrame],
    figures: dict[str, go.Figure],
) -> None:
    """One self-contained HTML file: plotly.js is embedded once, then every figure."""
    parts = [
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
        "<style>body{font-family:sans-serif;margin:2em} table{border-collapse:collapse}"
        " td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}</style></head><body>",
        f"<h1>{html.escape(title)}</h1><p>{html.escape(note)}</p>",
    ]
    for name, table in tables.items():
        parts += [f"<h2>{html.escape(name)}</h2>", table.to_html()]
    for i, (name, fig) in enumerate(figures.items()):
        parts += [
            f"<h2>{html.escape(name)}</h2>",
            fig.to_html(full_html=False, include_plotlyjs=i == 0),
        ]
    parts.append("</body></html>")
    Path(path).write_text("\n".join(parts), encoding="utf-8")
