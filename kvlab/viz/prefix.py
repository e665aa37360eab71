"""Prefix sharing drawn: block tables pointing at shared pages, the sharing explorer, and
blocks held over time (the experiments are in kvlab.experiments.sharing).

- `format_table`, `block_table_figure`: block tables, printed compactly and drawn as
  logical blocks pointing at physical pages.
- `sharing_figure`, `SharingExplorer`: prompt tokens computed, hit rate and peak KV blocks
  as more requests share one preamble, with and without sharing.
- `blocks_figure`: KV blocks held after each step (n > 1 forks against separate requests).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import ipywidgets as widgets
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvlab.engine.requests import Prompt
from kvlab.experiments.sharing import MODES, measure_sharing
from kvlab.model.loading import LoadedModel
from kvlab.viz.app import App
from kvlab.viz.style import PALETTE, palette_color

SHARED_COLOR = "#d62728"  # pages referenced by more than one block table
BLOCK_SIZES = (8, 16, 32, 64)


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
        color, y = palette_color(i), rows[name]
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


SHARING_PANELS = (
    ("tokens computed", "prompt tokens computed"),
    ("hit rate %", "prefix hit rate (%)"),
    ("peak blocks", "peak KV blocks held"),
)


def sharing_figure(frame: pd.DataFrame) -> go.Figure:
    """Tokens computed, hit rate and peak blocks against the number of requests sharing
    the preamble, one line per mode (frame: rows of measure_sharing plus a "mode").

    Three panels side by side leave each x axis a third of the width: each gets a short
    title of its own ("requests"), the figure's title says what they count."""
    fig = make_subplots(
        rows=1, cols=3, subplot_titles=[t for _, t in SHARING_PANELS], horizontal_spacing=0.09
    )
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
    fig.update_xaxes(title_text="requests", type="log", dtick=0.30103)
    fig.update_annotations(font_size=13)  # the subplot titles
    fig.update_layout(
        height=400,
        title=dict(text="One preamble shared by n requests", font_size=15),
        legend=dict(orientation="h", yanchor="top", y=-0.3, xanchor="center", x=0.5),
        margin=dict(t=100, b=110),
    )
    return fig


def explorer_title(block_size: int, rows: dict[str, dict[str, float]]) -> str:
    """The explorer's headline for one setting, from its measured rows (mode -> row): the
    request count is the rows' own, the count the tokens were measured for."""
    counts = {row["requests"] for row in rows.values()}
    if len(counts) != 1:
        raise ValueError(f"rows measured for different request counts: {sorted(counts)}")
    computed = {mode: row["tokens computed"] for mode, row in rows.items()}
    return (
        f"block size {block_size}, {counts.pop()} requests:<br>"
        f"{computed['with sharing']} prompt tokens computed with sharing, "
        f"{computed['without sharing']} without"
    )


class SharingExplorer(App):
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
                self.results[key], _ = measure_sharing(
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
        """Measure the current setting (once) and redraw the current block size's points.

        Serving a new setting takes seconds while the slider already shows it, so the
        headline first says that setting is being measured: left alone, it would name the
        previous count (and its tokens) beside the new one."""
        n, size = self.requests.value, self.block_size.value
        if any((mode, size, n) not in self.results for mode in MODES):
            self.figure.layout.title.text = f"block size {size}, {n} requests: measuring ..."
        self.measure(n, size)
        fresh = sharing_figure(self.table())
        with self.figure.batch_update():
            for trace, new in zip(self.figure.data, fresh.data):
                trace.x, trace.y = new.x, new.y
            self.figure.layout.title.text = explorer_title(
                size, {mode: self._row(mode, size, n) for mode in MODES}
            )

    def _row(self, mode: str, block_size: int, n: int) -> dict[str, float]:
        return self.results[(mode, block_size, n)]

    def view(self) -> widgets.Widget:
        return widgets.VBox([widgets.HBox([self.requests, self.block_size]), self.figure])


def blocks_figure(stats_by_name: dict[str, pd.DataFrame], title: str) -> go.Figure:
    """KV blocks held after each engine step, one line per run."""
    fig = go.Figure(
        [
            go.Scatter(
                x=stats["step"].tolist(),
                y=stats["blocks_used"].tolist(),
                name=name,
                mode="lines+markers",
                line=dict(shape="hv", color=palette_color(i)),
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
