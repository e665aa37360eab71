"""Notebook 03's helpers, figures and widget: prefix sharing measured live on the real model.

- `serve` / `serve_sharing`: run requests so that later ones can hit earlier ones' cached
  prefix (one after another, or one first and the rest while it decodes).
- `format_table`, `block_table_figure`: block tables, printed compactly and drawn as
  logical blocks pointing at physical pages.
- `measure_sharing`, `sharing_figure`, `SharingExplorer`: prompt tokens computed, hit
  rate and peak KV blocks as more requests share one preamble, with and without sharing.
- `fork_vs_separate`, `blocks_figure`: n > 1 sampling with copy-on-write forks against
  n separate requests.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import replace

import ipywidgets as widgets
import pandas as pd
import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from kvlab import texts
from kvlab.config import EngineConfig, SamplingParams
from kvlab.engine import Engine, Prompt
from kvlab.model_loading import LoadedModel
from kvlab.outputs import RequestOutput

MIB = 2**20
PALETTE = qualitative.Plotly
SHARED_COLOR = "#d62728"  # pages referenced by more than one block table
MODES = {"with sharing": "hash", "without sharing": None}
BLOCK_SIZES = (8, 16, 32, 64)


# --- prompts and serving --------------------------------------------------------------
def preamble_prompts(n: int) -> list[str]:
    """n doc-QA style prompts: the shared ~300-token preamble, then a short numbered question
    (questions cycle past 48, the number keeps every prompt distinct)."""
    questions = texts.questions()
    return [
        f"{texts.preamble()}\n\nQuestion {i + 1}: {questions[i % len(questions)]}" for i in range(n)
    ]


def common_prefix(a: Seq[int], b: Seq[int]) -> int:
    """Length of the longest common prefix of two token-id lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def drain(engine: Engine) -> None:
    """Step the engine until no request is waiting or running."""
    while engine.has_unfinished():
        engine.step()


def output_of(engine: Engine, request_id: int) -> RequestOutput:
    """The finished output of one request."""
    return next(o for o in engine.finished if o.request_id == request_id)


def serve(
    engine: Engine,
    prompt: Prompt,
    params: SamplingParams | None = None,
    *,
    salt: str | None = None,
    chat: bool | None = None,
) -> RequestOutput:
    """Serve one request to completion (anything already queued runs too)."""
    request_id = engine.add_request(prompt, params, salt=salt, chat=chat)
    drain(engine)
    return output_of(engine, request_id)


def serve_sharing(
    engine: Engine, prompts: Seq[Prompt], params: SamplingParams
) -> list[RequestOutput]:
    """The first prompt arrives alone and is prefilled; the others arrive while it decodes.

    Requests admitted in the same prefill step cannot share (a prompt's blocks are indexed
    only once it is computed), so this is the order in which a shared preamble pays off:
    one request warms the cache, the rest reuse it. Deterministic (no clocks involved).
    """
    ids = [engine.add_request(prompts[0], params)]
    engine.step()
    ids += [engine.add_request(p, params) for p in prompts[1:]]
    drain(engine)
    return [output_of(engine, i) for i in ids]


# --- block tables ---------------------------------------------------------------------
def format_table(table: Seq[int]) -> str:
    """A block table with runs of consecutive pages collapsed: [0, 1, 2, 7] -> '0-2, 7'."""
    parts: list[str] = []
    start = prev = None
    for block in [*table, None]:
        if prev is not None and block == prev + 1:
            prev = block
            continue
        if start is not None:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = block
    return ", ".join(parts) if parts else "(empty)"


def shared_pages(tables: dict[str, Seq[int]]) -> list[int]:
    """Physical pages that appear in more than one of the tables, sorted."""
    seen: dict[int, int] = {}
    for table in tables.values():
        for block in set(table):
            seen[block] = seen.get(block, 0) + 1
    return sorted(b for b, count in seen.items() if count > 1)


def block_table_figure(
    tables: dict[str, Seq[int]], block_size: int, title: str | None = None
) -> go.Figure:
    """Each request's block table as a row of logical blocks with a line from logical block
    i to the physical page it points at (the middle row). Pages referenced by more than one
    table, and the lines into them, are red: those tokens are stored and computed once."""
    shared = set(shared_pages(tables))
    rows = {name: (1 if i == 0 else -i) for i, name in enumerate(tables)}
    fig = go.Figure()
    for i, (name, table) in enumerate(tables.items()):
        color, y = PALETTE[i % len(PALETTE)], rows[name]
        for is_shared in (False, True):
            xs: list[float | None] = []
            ys: list[float | None] = []
            for logical, page in enumerate(table):
                if (page in shared) == is_shared:
                    xs += [logical, page, None]
                    ys += [y, 0, None]
            fig.add_scatter(
                x=xs,
                y=ys,
                mode="lines",
                line=dict(width=1, color=SHARED_COLOR if is_shared else color),
                opacity=0.6,
                hoverinfo="skip",
                showlegend=False,
            )
        fig.add_scatter(
            x=list(range(len(table))),
            y=[y] * len(table),
            mode="markers",
            name=f"{name}: {len(table)} blocks",
            marker=dict(symbol="square", size=7, color=color),
            text=[
                f"{name} logical block {j} (tokens {j * block_size}-{(j + 1) * block_size - 1})"
                f" -> page {page}"
                for j, page in enumerate(table)
            ],
            hovertemplate="%{text}<extra></extra>",
        )
    pages = sorted({b for table in tables.values() for b in table})
    fig.add_scatter(
        x=pages,
        y=[0] * len(pages),
        mode="markers",
        name=f"physical pages ({len(shared)} shared)",
        marker=dict(
            symbol="square",
            size=7,
            color=[SHARED_COLOR if p in shared else "#7f7f7f" for p in pages],
        ),
        text=[f"page {p}" + (" (shared)" if p in shared else "") for p in pages],
        hovertemplate="%{text}<extra></extra>",
    )
    fig.update_yaxes(
        tickvals=[0, *rows.values()],
        ticktext=["physical pages", *(f"{name} table" for name in rows)],
        range=[min(rows.values()) - 0.4, 1.4],
        zeroline=False,
    )
    fig.update_xaxes(title_text="logical block index (table rows) / physical page id (middle)")
    fig.update_layout(
        title=title or "Block tables pointing at physical KV pages",
        height=220 + 90 * len(tables),
        legend=dict(orientation="h", yanchor="bottom", y=1.0, xanchor="right", x=1),
        margin=dict(t=90, b=40),
    )
    return fig


# --- hash vs radix -------------------------------------------------------------------
def index_hits(
    model: LoadedModel,
    prompts: Seq[Prompt],
    block_sizes: Seq[int] = (16, 64),
    kinds: Seq[str] = ("hash", "radix"),
    max_new_tokens: int = 2,
    max_model_len: int = 1024,
) -> pd.DataFrame:
    """Serve `prompts` one after another under each prefix index and block size; one row
    per request: its prompt tokens, the longest prefix it shares with an earlier prompt,
    and the prompt tokens each index served from the cache ("hash/16", "radix/64", ...)."""
    frame = pd.DataFrame(index=pd.RangeIndex(len(prompts), name="request"))
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    for block_size in block_sizes:
        for kind in kinds:
            config = EngineConfig(
                cache="paged",
                block_size=block_size,
                prefix_caching=kind,
                max_model_len=max_model_len,
                kv_budget_tokens=4 * max_model_len,
            )
            engine = Engine(model, config)
            if "prompt tokens" not in frame:
                ids = [engine.encode(p) for p in prompts]
                frame["prompt tokens"] = [len(i) for i in ids]
                frame["shared with earlier"] = [
                    max((common_prefix(ids[j], ids[i]) for j in range(i)), default=0)
                    for i in range(len(ids))
                ]
            hits = [serve(engine, p, params).metrics.prefix_hit_tokens for p in prompts]
            frame[f"{kind}/{block_size}"] = hits
    return frame


# --- sharing one preamble -------------------------------------------------------------
def measure_sharing(
    model: LoadedModel,
    prompts: Seq[Prompt],
    prefix_caching: str | None,
    block_size: int = 16,
    max_new_tokens: int = 4,
    max_model_len: int = 1024,
) -> dict[str, float]:
    """Serve `prompts` (first alone, the rest while it decodes) and count what it cost:
    prompt tokens, tokens computed, hit rate and peak blocks / MiB of KV held."""
    per_request = -(-(max_model_len) // block_size)
    config = EngineConfig(
        cache="paged",
        block_size=block_size,
        prefix_caching=prefix_caching,
        max_model_len=max_model_len,
        kv_budget_tokens=per_request * block_size * len(prompts),
    )
    engine = Engine(model, config)
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    outputs = serve_sharing(engine, prompts, params)
    stats = engine.stats()
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    hits = sum(o.metrics.prefix_hit_tokens for o in outputs)
    return {
        "requests": len(prompts),
        "block size": block_size,
        "prompt tokens": prompt_tokens,
        "tokens computed": prompt_tokens - hits,
        "hit rate %": round(100 * hits / prompt_tokens, 1),
        "peak blocks": int(stats["blocks_used"].max()),
        "peak KV MiB": round(float(stats["reserved_bytes"].max()) / MIB, 1),
    }


def sharing_table(
    model: LoadedModel,
    prompts: Seq[Prompt],
    counts: Seq[int],
    block_size: int = 16,
    max_new_tokens: int = 4,
) -> pd.DataFrame:
    """measure_sharing with and without sharing for the first n prompts, n in `counts`."""
    rows = [
        {"mode": mode, **measure_sharing(model, prompts[:n], kind, block_size, max_new_tokens)}
        for n in counts
        for mode, kind in MODES.items()
    ]
    return pd.DataFrame(rows)


SHARING_PANELS = (
    ("tokens computed", "prompt tokens computed"),
    ("hit rate %", "prefix hit rate (%)"),
    ("peak blocks", "peak KV blocks held"),
)


def sharing_figure(frame: pd.DataFrame) -> go.Figure:
    """Tokens computed, hit rate and peak blocks against the number of requests sharing
    the preamble, one line per mode (frame: rows of measure_sharing plus a "mode")."""
    fig = make_subplots(rows=1, cols=3, subplot_titles=[t for _, t in SHARING_PANELS])
    for i, mode in enumerate(MODES):
        rows = frame[frame["mode"] == mode].sort_values("requests")
        for col, (column, _) in enumerate(SHARING_PANELS, start=1):
            fig.add_scatter(
                x=rows["requests"].tolist(),
                y=rows[column].tolist(),
                name=mode,
                legendgroup=mode,
                showlegend=col == 1,
                mode="lines+markers",
                line=dict(color=PALETTE[i]),
                row=1,
                col=col,
            )
    fig.update_xaxes(title_text="requests sharing the preamble", type="log", dtick=0.30103)
    fig.update_layout(height=360, title="One preamble, many requests")
    return fig


class SharingExplorer:
    """A slider for how many requests share the preamble and a dropdown for the block
    size: each new setting is served live with and without prefix sharing (once; results
    are kept) and the figure redraws every count measured at the current block size."""

    def __init__(
        self,
        model: LoadedModel,
        prompts: Seq[Prompt],
        requests: int = 4,
        block_size: int = 16,
        max_new_tokens: int = 4,
    ):
        self.model, self.prompts, self.max_new_tokens = model, list(prompts), max_new_tokens
        self.results: dict[tuple[str, int, int], dict[str, float]] = {}  # (mode, bs, n) -> row
        self.requests = widgets.IntSlider(
            value=requests,
            min=1,
            max=len(self.prompts),
            description="requests",
            continuous_update=False,
        )
        sizes = sorted({*BLOCK_SIZES, block_size})
        self.block_size = widgets.Dropdown(options=sizes, value=block_size, description="block")
        self.figure = go.FigureWidget(sharing_figure(self.table()))
        for control in (self.requests, self.block_size):
            control.observe(lambda _change: self.refresh(), names="value")
        self.refresh()

    def measure(self, n: int, block_size: int) -> None:
        """Serve the first n prompts at this block size in both modes (unless done)."""
        for mode, kind in MODES.items():
            key = (mode, block_size, n)
            if key not in self.results:
                self.results[key] = measure_sharing(
                    self.model, self.prompts[:n], kind, block_size, self.max_new_tokens
                )

    def sweep(self, counts: Seq[int]) -> pd.DataFrame:
        """Measure several counts at the current block size; returns table()."""
        for n in counts:
            self.measure(n, self.block_size.value)
        self.refresh()
        return self.table()

    def table(self, block_size: int | None = None) -> pd.DataFrame:
        """Measured rows at `block_size` (default: the dropdown's), by requests then mode."""
        size = self.block_size.value if block_size is None else block_size
        order = list(MODES)
        keys = sorted(
            (key for key in self.results if key[1] == size),
            key=lambda key: (key[2], order.index(key[0])),
        )
        columns = ["mode", "requests", "block size", "prompt tokens", "tokens computed"]
        columns += ["hit rate %", "peak blocks", "peak KV MiB"]
        return pd.DataFrame([{"mode": k[0], **self.results[k]} for k in keys], columns=columns)

    def refresh(self) -> None:
        """Measure the current setting (once) and redraw the current block size's points."""
        n, size = self.requests.value, self.block_size.value
        self.measure(n, size)
        fresh = sharing_figure(self.table())
        with self.figure.batch_update():
            for trace, new in zip(self.figure.data, fresh.data):
                trace.x, trace.y = new.x, new.y
            self.figure.layout.title = (
                f"block size {size}: {n} requests computed "
                f"{self._row('with sharing', size, n)['tokens computed']} prompt tokens with "
                f"sharing, {self._row('without sharing', size, n)['tokens computed']} without"
            )

    def _row(self, mode: str, block_size: int, n: int) -> dict[str, float]:
        return self.results[(mode, block_size, n)]

    def widget(self) -> widgets.Widget:
        return widgets.VBox([widgets.HBox([self.requests, self.block_size]), self.figure])

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget())


# --- n > 1 sampling -------------------------------------------------------------------
def fork_vs_separate(
    model: LoadedModel,
    prompt: Prompt,
    params: SamplingParams,
    block_size: int = 16,
    max_model_len: int = 1024,
) -> tuple[dict[str, dict[str, float]], dict[str, pd.DataFrame]]:
    """`params.n` samples of one prompt two ways, prefix caching off in both: one request
    whose samples fork with copy-on-write, and n separate requests (seeds seed + i, which
    are the seeds the forks use). Returns a summary per way and each run's step stats."""
    n = params.n
    per_request = -(-(max_model_len) // block_size)
    config = EngineConfig(
        cache="paged",
        block_size=block_size,
        max_model_len=max_model_len,
        kv_budget_tokens=per_request * block_size * n,
    )
    seeds = [None if params.seed is None else params.seed + i for i in range(n)]
    runs = {
        f"n={n}, copy-on-write": [params],
        f"{n} separate requests": [replace(params, n=1, seed=seed) for seed in seeds],
    }
    summary, stats = {}, {}
    for name, param_list in runs.items():
        engine = Engine(model, config)
        outputs = engine.generate([prompt] * len(param_list), param_list)
        samples = [s for o in outputs for s in o.samples]
        stats[name] = engine.stats()
        summary[name] = {
            "samples": len(samples),
            "tokens computed": int(stats[name]["tokens"].sum()),
            "peak blocks": int(stats[name]["blocks_used"].max()),
            "peak KV MiB": round(float(stats[name]["reserved_bytes"].max()) / MIB, 1),
            "copy-on-write copies": engine.cache.copied_blocks,
            "texts": [s.text for s in samples],
        }
    return summary, stats


def blocks_figure(stats_by_name: dict[str, pd.DataFrame], title: str) -> go.Figure:
    """KV blocks held after each engine step, one line per run."""
    fig = go.Figure(
        [
            go.Scatter(
                x=stats["step"].tolist(),
                y=stats["blocks_used"].tolist(),
                name=name,
                mode="lines+markers",
                line=dict(shape="hv", color=PALETTE[i % len(PALETTE)]),
            )
            for i, (name, stats) in enumerate(stats_by_name.items())
        ]
    )
    fig.update_layout(
        title=title,
        xaxis_title="engine step",
        yaxis_title="KV blocks held",
        yaxis_rangemode="tozero",
        height=360,
    )
    return fig
