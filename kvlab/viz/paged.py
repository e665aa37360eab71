"""Notebook 02's figures and widgets: the paged cache against the naive one, measured live."""

from __future__ import annotations

import ipywidgets as widgets
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvlab.build import Engine
from kvlab.config import EngineConfig
from kvlab.model.loading import LoadedModel
from kvlab.units import MiB, ceil_div
from kvlab.viz.app import App
from kvlab.viz.style import PALETTE, palette_color
from kvlab.workloads import Request

BLOCK_SIZES = (1, 4, 8, 16, 32, 64, 128)


def _busy(stats: pd.DataFrame) -> pd.DataFrame:
    """Steps that hold some KV memory, with the waste fraction of each."""
    busy = stats[stats["reserved_bytes"] > 0]
    return busy.assign(waste_frac=busy["waste_bytes"] / busy["reserved_bytes"])


def occupancy_table(stats_by_name: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """One row per cache: steps, peak running, mean/peak waste %, peak blocks used/total,
    peak reserved and live MiB, preemptions.

    Everything here is deterministic for greedy runs of a workload arriving at once.
    """
    rows = {}
    for name, stats in stats_by_name.items():
        busy = _busy(stats)
        rows[name] = {
            "steps": len(stats),
            "peak running": int(stats["running"].max()),
            "mean waste %": round(100 * busy["waste_frac"].mean(), 1),
            "peak waste %": round(100 * busy["waste_frac"].max(), 1),
            "peak blocks used": int(stats["blocks_used"].max()),
            "blocks": int(stats["blocks_used"].iloc[0] + stats["blocks_free"].iloc[0]),
            "peak reserved MiB": round(stats["reserved_bytes"].max() / MiB, 1),
            "peak live MiB": round(stats["live_bytes"].max() / MiB, 1),
            "preemptions": int(stats["preemptions"].iloc[-1]) if len(stats) else 0,
        }
    return pd.DataFrame.from_dict(rows, orient="index")


def memory_panels(stats_by_name: dict[str, pd.DataFrame], x: str = "step") -> go.Figure:
    """Reserved (solid) vs live (dotted) KV, waste % and running sequences, one colour per
    cache, against `x` ("step" or "time_s") of each cache's `engine.stats()`."""
    fig = make_subplots(
        rows=3,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.06,
        row_heights=[0.45, 0.25, 0.3],
        subplot_titles=("KV memory", "waste: reserved but not written", "running sequences"),
    )
    for i, (name, stats) in enumerate(stats_by_name.items()):
        color, busy = palette_color(i), _busy(stats)
        panels = [
            (1, stats, stats["reserved_bytes"] / MiB, "reserved", "solid"),
            (1, stats, stats["live_bytes"] / MiB, "live", "dot"),
            (2, busy, 100 * busy["waste_frac"], "waste %", "solid"),
            (3, stats, stats["running"], "running", "solid"),
        ]
        for row, frame, y, label, dash in panels:
            shape = "hv" if row == 3 else "linear"
            fig.add_scatter(
                x=frame[x],
                y=y,
                name=f"{name} {label}",
                legendgroup=name,
                showlegend=row == 1,
                line=dict(color=color, dash=dash, shape=shape),
                row=row,
                col=1,
            )
    budget = next(iter(stats_by_name.values()))["budget_bytes"].max() / MiB
    fig.add_hline(y=budget, line_dash="dash", annotation_text="KV budget", row=1, col=1)
    fig.update_yaxes(title_text="MiB", row=1, col=1)
    fig.update_yaxes(title_text="%", range=[0, 100], row=2, col=1)
    fig.update_yaxes(title_text="sequences", rangemode="tozero", row=3, col=1)
    fig.update_xaxes(
        title_text={"time_s": "seconds", "step": "engine step"}.get(x, x), row=3, col=1
    )
    fig.update_layout(height=650, title="Naive vs paged KV cache on the same workload")
    return fig


class BlockMapExplorer(App):
    """The physical KV blocks as a grid, coloured by the request owning each (blank =
    free), with a slider over engine steps. Needs an engine run with record_block_map=True.

    Every owned block is labelled with its request's number, and with a "*" when another
    request held it at an earlier step (freed, then handed out again), so a static copy of
    the figure (no hover) still shows who owns what and where blocks were reused."""

    def __init__(self, engine: Engine, blocks_per_row: int = 32):
        self.maps = engine.telemetry.block_maps
        if not self.maps:
            raise ValueError(
                "engine.telemetry.block_maps is empty: run the engine with "
                "EngineConfig(record_block_map=True) first"
            )
        self.stats = engine.stats()
        self.reused = _reused(self.maps)  # per step: blocks another request held before
        self.num_blocks, self.per_row = len(self.maps[0]), min(blocks_per_row, len(self.maps[0]))
        self.rows = ceil_div(self.num_blocks, self.per_row)
        busiest = int(self.stats["blocks_used"].idxmax()) + 1
        self.slider = self.control = widgets.IntSlider(
            value=busiest, min=1, max=len(self.maps), description="step"
        )
        n = len(PALETTE)  # a discrete colour scale: value k in [k - 0.5, k + 0.5] -> PALETTE[k]
        scale = [[(k + e) / n, PALETTE[k]] for k in range(n) for e in (0, 1)]
        self.figure = go.FigureWidget(
            go.Heatmap(
                colorscale=scale,
                zmin=-0.5,
                zmax=n - 0.5,
                showscale=False,
                xgap=1,
                ygap=1,
                hovertemplate="%{customdata}<extra></extra>",
                texttemplate="%{text}",
                textfont=dict(size=9, color="white"),
            ),
            layout=go.Layout(
                height=max(160, 26 * self.rows + 90),
                xaxis=dict(visible=False),
                yaxis=dict(visible=False, autorange="reversed", scaleanchor="x"),
                plot_bgcolor="#e5e5e5",
                margin=dict(l=10, r=10, t=50, b=10),
            ),
        )
        self.slider.observe(lambda _change: self.refresh(), names="value")
        self.refresh()

    def grid(self, step: int) -> tuple[list[list[float | None]], list[list[str]], list[list[str]]]:
        """Colour index (None = free), hover text and cell label of every block after
        `step` (1-based); the label is the owner's number, "*" when the block is reused."""
        owners, reused = self.maps[step - 1], self.reused[step - 1]
        z: list[list[float | None]] = [[None] * self.per_row for _ in range(self.rows)]
        text = [[""] * self.per_row for _ in range(self.rows)]
        label = [[""] * self.per_row for _ in range(self.rows)]
        for block, owner in enumerate(owners):
            r, c = divmod(block, self.per_row)
            z[r][c] = None if owner < 0 else owner % len(PALETTE)
            text[r][c] = f"block {block}<br>" + (f"request {owner}" if owner >= 0 else "free")
            if owner >= 0:
                again = block in reused
                label[r][c] = f"{owner}*" if again else str(owner)
                text[r][c] += " (reused: another request held it before)" if again else ""
        return z, text, label

    def refresh(self) -> None:
        """Redraw the map at the slider's step."""
        step = self.slider.value
        z, text, label = self.grid(step)
        row = self.stats.iloc[step - 1]
        with self.figure.batch_update():
            trace = self.figure.data[0]
            trace.z, trace.customdata, trace.text = z, text, label
            self.figure.layout.title = (
                f"step {step} ({row['phase']}): {row['blocks_used']} of {self.num_blocks} "
                f"blocks used, {row['running']} running, {row['waiting']} waiting, "
                f"{len(self.reused[step - 1])} reused<br><sup>a cell is a block, labelled "
                "with the request that owns it; *: another request held it before; grey: "
                "free</sup>"
            )


def _reused(maps: list[list[int]]) -> list[set[int]]:
    """Per step, the owned blocks that some other request owned at an earlier step."""
    held_by: dict[int, set[int]] = {}  # block -> every request that has owned it so far
    out = []
    for owners in maps:
        for block, owner in enumerate(owners):
            if owner >= 0:
                held_by.setdefault(block, set()).add(owner)
        out.append({b for b, owner in enumerate(owners) if owner >= 0 and len(held_by[b]) > 1})
    return out


class BlockSizeExplorer(App):
    """Pick a block size: the paged engine serves `requests` live at that size and the
    figure gains a point for tail waste % and block-table entries per sequence, so the
    sizes measured so far show the trade-off (small blocks: little waste, long tables)."""

    def __init__(
        self,
        model: LoadedModel,
        requests: list[Request],
        budget_tokens: int,
        block_size: int = 16,
        max_model_len: int | None = None,
    ):
        self.model, self.requests, self.budget_tokens = model, requests, budget_tokens
        self.max_model_len = max_model_len
        self.results: dict[int, dict[str, float]] = {}  # block size -> measured point
        self.dropdown = self.control = widgets.Dropdown(
            options=list(BLOCK_SIZES), value=block_size, description="block size"
        )
        self.figure = go.FigureWidget(
            make_subplots(
                rows=1, cols=2, subplot_titles=("tail waste (% of reserved)", "block-table entries")
            )
        )
        self.figure.add_bar(name="waste %", row=1, col=1, marker_color=PALETTE[1])
        self.figure.add_bar(name="per sequence", row=1, col=2, marker_color=PALETTE[0])
        self.figure.update_xaxes(title_text="block size (tokens)", type="category")
        self.figure.update_yaxes(type="log", row=1, col=2)
        self.figure.update_layout(height=360, showlegend=False)
        self.dropdown.observe(lambda _change: self.refresh(), names="value")
        self.refresh()

    def measure(self, block_size: int) -> dict[str, float]:
        """Serve the workload with this block size; mean waste % and table sizes over steps."""
        config = EngineConfig(
            cache="paged",
            block_size=block_size,
            kv_budget_tokens=self.budget_tokens,
            max_model_len=self.max_model_len,
        )
        engine = Engine(self.model, config)
        engine.run(self.requests, ignore_eos=True)
        busy = _busy(engine.stats())
        return {
            "waste %": round(100 * busy["waste_frac"].mean(), 1),
            "entries per sequence": round((busy["blocks_used"] / busy["running"]).mean(), 1),
            "peak table entries": int(busy["blocks_used"].max()),
        }

    def table(self) -> pd.DataFrame:
        """The sizes measured so far, one row each, by block size."""
        frame = pd.DataFrame.from_dict(self.results, orient="index")
        return frame.rename_axis("block size").sort_index()

    def refresh(self) -> None:
        """Measure the dropdown's block size (once) and redraw all measured points."""
        size = self.dropdown.value
        if size not in self.results:
            self.results[size] = self.measure(size)
        frame = self.table()
        labels = [str(s) for s in frame.index]
        with self.figure.batch_update():
            self.figure.data[0].x, self.figure.data[0].y = labels, frame["waste %"].tolist()
            self.figure.data[1].x = labels
            self.figure.data[1].y = frame["entries per sequence"].tolist()
            self.figure.layout.title = f"block size {size}: {len(frame)} sizes measured"
