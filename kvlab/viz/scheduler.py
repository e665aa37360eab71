"""Notebook 05's figures and widget: the scheduler under memory pressure.

- `gantt_figure`: one row per request, a bar for every state it was in (waiting, running,
  preempted to recompute, swapped out), from `engine.scheduler.events`.
- `free_blocks_figure`: free KV blocks after every step, preemptions marked.
- `pressure_figure`: both, stacked on one shared axis (engine steps or seconds).
- `cost_figure`, `gaps_figure`: swap vs recompute cost by victim length; the decode
  streams' time per token while a long prompt arrives.
- `StressExplorer`: budget, burst size and policy controls that re-run a burst live and
  redraw the pressure figure.

`x="step"` draws against engine steps (deterministic for greedy runs: the figure is the
same on every machine); `x="time"` against engine seconds (what a user waits).
"""

from __future__ import annotations

import ipywidgets as widgets
import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvlab.build import Engine
from kvlab.config import EngineConfig
from kvlab.engine.scheduler import Event
from kvlab.experiments import stress
from kvlab.model.loading import LoadedModel
from kvlab.units import MiB, ceil_div
from kvlab.viz.app import App

STATE_COLORS = {
    "waiting": "#c7c7c7",
    "running": "#2ca02c",
    "preempted": "#d62728",  # blocks dropped: recomputed on resume
    "swapped": "#ff7f0e",  # blocks copied to host memory
}
X_TITLES = {"step": "engine step", "time": "engine time (s)"}
POLICIES = ("recompute", "swap")


def _check_x(x: str) -> None:
    if x not in X_TITLES:
        raise ValueError(f"x={x!r} is unknown; choose 'step' or 'time'")


def _events_and_end(engine: Engine, x: str) -> tuple[list[Event], float, float]:
    """Events on the x axis, the axis' end, and its origin (seconds of the first event)."""
    _check_x(x)
    stats = engine.stats()
    if x == "step":
        return stress.step_events(engine), float(len(stats)), 0.0
    events = stress.engine_events(engine)
    origin = min((e.time_s for e in events), default=0.0)
    end = float(stats["time_s"].iloc[-1]) if len(stats) else origin
    shifted = [Event(e.time_s - origin, e.request_id, e.state) for e in events]
    return shifted, end - origin, origin


def gantt_traces(engine: Engine, x: str = "step") -> dict[str, dict[str, list]]:
    """Bar data of the Gantt chart, per state: y (request labels), base (start), x (length)."""
    events, end, _ = _events_and_end(engine, x)
    bars = stress.gantt_intervals(events, end)
    out = {}
    for state in stress.STATES:
        rows = bars[bars["state"] == state]
        out[state] = {
            "y": [f"req {r}" for r in rows["request_id"]],
            "base": rows["start"].tolist(),
            "x": (rows["end"] - rows["start"]).tolist(),
        }
    return out


def free_blocks_trace(engine: Engine, x: str = "step") -> dict[str, list]:
    """Free blocks over the run (x, y: after every step, starting from the empty pool) and
    the preemptions (px, py: where the scheduler preempted, at the free blocks it had
    then; ptext: how many requests and which)."""
    events, _, origin = _events_and_end(engine, x)
    stats = engine.stats()
    xs = stats["step"].tolist() if x == "step" else (stats["time_s"] - origin).tolist()
    xs = [0.0 if x == "time" else 0, *xs]
    ys = [int(engine.cache.num_blocks), *stats["blocks_free"].astype(int).tolist()]
    victims: dict[float, list[int]] = {}
    for event in events:
        if event.state in ("preempted", "swapped"):
            victims.setdefault(event.time_s, []).append(event.request_id)
    px = sorted(victims)
    before = np.searchsorted(np.asarray(xs, dtype=float), px, side="right") - 1
    return {
        "x": xs,
        "y": ys,
        "px": px,
        "py": [ys[max(i, 0)] for i in before],
        "ptext": [", ".join(f"req {r}" for r in victims[p]) for p in px],
    }


def _request_labels(engine: Engine) -> list[str]:
    ids = sorted({e.request_id for e in engine.scheduler.events})
    return [f"req {r}" for r in ids]


def pressure_figure(engine: Engine, x: str = "step", title: str | None = None) -> go.Figure:
    """The Gantt chart of requests above the free blocks, on one shared x axis."""
    fig = make_subplots(
        rows=2,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.08,
        row_heights=[0.65, 0.35],
        subplot_titles=("requests", "free KV blocks"),
    )
    for state, color in STATE_COLORS.items():
        fig.add_bar(
            orientation="h",
            name=state,
            marker_color=color,
            hovertemplate="%{y}: " + state + " from %{base} for %{x}<extra></extra>",
            row=1,
            col=1,
        )
    fig.add_scatter(
        name="free blocks", mode="lines", line=dict(color="#1f77b4", shape="hv"), row=2, col=1
    )
    fig.add_scatter(
        name="preemption",
        mode="markers",
        marker=dict(color=STATE_COLORS["preempted"], symbol="x", size=9),
        hovertemplate="%{x}: preempted %{text} (%{y} blocks free)<extra></extra>",
        row=2,
        col=1,
    )
    fig.update_layout(barmode="overlay", height=520, legend_traceorder="normal")
    fig.update_yaxes(title_text="blocks", rangemode="tozero", row=2, col=1)
    fig.update_xaxes(title_text=X_TITLES[x], row=2, col=1)
    update_pressure_figure(fig, engine, x, title)
    return fig


def update_pressure_figure(
    fig: go.Figure, engine: Engine, x: str = "step", title: str | None = None
) -> None:
    """Redraw a `pressure_figure` (or its FigureWidget) with another engine's run."""
    bars, free = gantt_traces(engine, x), free_blocks_trace(engine, x)
    labels = _request_labels(engine)
    with _batch(fig):
        for trace, state in zip(fig.data[:4], stress.STATES):
            trace.y, trace.base, trace.x = bars[state]["y"], bars[state]["base"], bars[state]["x"]
        fig.data[4].x, fig.data[4].y = free["x"], free["y"]
        fig.data[5].x, fig.data[5].y, fig.data[5].text = free["px"], free["py"], free["ptext"]
        fig.layout.yaxis.update(
            categoryorder="array", categoryarray=labels, autorange="reversed", type="category"
        )
        fig.layout.yaxis2.range = [0, engine.cache.num_blocks * 1.05]
        fig.layout.title = title or _default_title(engine)


def _batch(fig: go.Figure):
    if isinstance(fig, go.FigureWidget):
        return fig.batch_update()
    from contextlib import nullcontext

    return nullcontext()


def _default_title(engine: Engine) -> str:
    s = engine.scheduler
    config = engine.config
    moved = (
        f"{s.swapped_bytes / MiB:.1f} MiB swapped out"
        if config.preemption == "swap"
        else f"{s.recomputed_tokens} tokens recomputed"
    )
    return (
        f"{len(engine.finished)} requests, {engine.cache.num_blocks} blocks of "
        f"{config.block_size}: {s.preemptions} preemptions ({config.preemption}), {moved}"
    )


def gantt_figure(engine: Engine, x: str = "step", title: str | None = None) -> go.Figure:
    """The Gantt chart alone: one row per request, a bar per state it was in."""
    fig = go.Figure(
        [
            go.Bar(orientation="h", name=state, marker_color=STATE_COLORS[state], **data)
            for state, data in gantt_traces(engine, x).items()
        ]
    )
    fig.update_layout(
        barmode="overlay",
        height=max(240, 26 * len(_request_labels(engine)) + 120),
        xaxis_title=X_TITLES[x],
        title=title or _default_title(engine),
    )
    fig.update_yaxes(
        type="category",
        categoryorder="array",
        categoryarray=_request_labels(engine),
        autorange="reversed",
    )
    return fig


def free_blocks_figure(engines: dict[str, Engine], x: str = "step") -> go.Figure:
    """Free blocks over the run, one line per engine (e.g. per preemption mode)."""
    fig = go.Figure()
    for name, engine in engines.items():
        free = free_blocks_trace(engine, x)
        fig.add_scatter(x=free["x"], y=free["y"], name=name, line=dict(shape="hv"))
    fig.update_layout(
        height=320, xaxis_title=X_TITLES[x], yaxis_title="free blocks", title="Free KV blocks"
    )
    return fig


def cost_figure(costs: pd.DataFrame) -> go.Figure:
    """Swap vs recompute by victim length (`stress.preemption_cost` rows of both modes):
    what one preemption added (extra_s, log scale) against a plain decode step and its
    own variation (left), and what had to move: MiB copied out to host memory, or tokens
    computed again (right)."""
    fig = make_subplots(
        rows=1,
        cols=2,
        subplot_titles=("what one preemption adds (ms, log)", "what one preemption moves"),
        specs=[[{}, {"secondary_y": True}]],
    )
    colors = {"swap": STATE_COLORS["swapped"], "recompute": STATE_COLORS["preempted"]}
    for mode, rows in costs.groupby("mode", sort=False):
        fig.add_scatter(
            x=rows["victim_tokens"],
            y=rows["extra_s"].clip(lower=1e-6) * 1e3,
            name=f"{mode}: extra time",
            line=dict(color=colors.get(mode)),
            row=1,
            col=1,
        )
    by_length = costs.groupby("victim_tokens", sort=True)
    baseline = by_length["decode_step_s"].median()
    fig.add_scatter(
        x=baseline.index,
        y=baseline * 1e3,
        name="a plain decode step",
        line=dict(color="#7f7f7f", dash="dash"),
        row=1,
        col=1,
    )
    if "decode_spread_s" in costs:
        spread = by_length["decode_spread_s"].max().clip(lower=1e-6)
        fig.add_scatter(
            x=spread.index,
            y=spread * 1e3,
            name="decode steps' own spread (max - min)",
            line=dict(color="#7f7f7f", dash="dot"),
            row=1,
            col=1,
        )
    swap = costs[costs["mode"] == "swap"]
    recompute = costs[costs["mode"] == "recompute"]
    fig.add_bar(
        x=swap["victim_tokens"],
        y=swap["bytes_swapped"] / MiB,
        name="MiB swapped out (and back in)",
        marker_color=colors["swap"],
        offsetgroup=0,
        row=1,
        col=2,
    )
    fig.add_bar(
        x=recompute["victim_tokens"],
        y=recompute["tokens_recomputed"],
        name="tokens recomputed",
        marker_color=colors["recompute"],
        offsetgroup=1,
        row=1,
        col=2,
        secondary_y=True,
    )
    fig.update_xaxes(title_text="victim length (tokens)")
    fig.update_yaxes(title_text="ms", type="log", row=1, col=1)
    fig.update_yaxes(title_text="MiB", rangemode="tozero", row=1, col=2)
    fig.update_yaxes(title_text="tokens", rangemode="tozero", row=1, col=2, secondary_y=True)
    fig.update_layout(height=400, title="What one preemption costs", barmode="group")
    return fig


def gaps_figure(gaps_by_name: dict[str, pd.DataFrame]) -> go.Figure:
    """The decode streams' time per token, step after step, one line per configuration."""
    fig = go.Figure()
    for name, gaps in gaps_by_name.items():
        fig.add_scatter(
            x=list(range(1, len(gaps) + 1)),
            y=gaps["gap_s"] * 1e3,
            name=name,
            mode="lines+markers",
            text=gaps["phase"],
            hovertemplate="token %{x}: %{y:.0f} ms (%{text} step)<extra></extra>",
        )
    fig.update_layout(
        height=360,
        title="Running decodes: time between tokens while a long prompt arrives",
        xaxis_title="decode step of the running streams",
        yaxis_title="ms per token",
    )
    return fig


class StressExplorer(App):
    """Controls for the KV budget, the burst size and the preemption policy above a
    pressure figure; every change serves a fresh burst live and redraws the figure.

    The burst is `stress.burst(n, max_new_tokens)` served with `ignore_eos`; `results`
    holds the last run's `stress.burst_summary`.
    """

    def __init__(
        self,
        model: LoadedModel,
        budget_tokens: int = 128,
        burst: int = 6,
        policy: str = "recompute",
        max_new_tokens: int = 24,
        block_size: int = 8,
        max_burst: int = 12,
        x: str = "step",
    ):
        _check_x(x)
        self.model, self.max_new_tokens, self.block_size, self.x = (
            model,
            max_new_tokens,
            block_size,
            x,
        )
        probe = Engine(model, EngineConfig(cache="paged", max_model_len=512))
        largest = stress.burst(max_burst, max_new_tokens)
        # One request alone must fit (the engine rejects it otherwise), with a block to spare;
        # the most: everything the largest burst could ever hold.
        need = max(len(probe.encode(r.prompt)) for r in largest) + max_new_tokens
        low = block_size * (ceil_div(need, block_size) + 1)
        high = block_size * sum(
            ceil_div(len(probe.encode(r.prompt)) + max_new_tokens, block_size) for r in largest
        )
        self.budget = widgets.IntSlider(
            value=min(max(budget_tokens, low), high),
            min=low,
            max=high,
            step=block_size,
            description="KV budget",
            continuous_update=False,
        )
        self.burst = widgets.IntSlider(
            value=burst, min=1, max=max_burst, description="burst", continuous_update=False
        )
        self.policy = widgets.ToggleButtons(options=list(POLICIES), value=policy)
        self.control = widgets.HBox([self.budget, self.burst, self.policy])
        self.engine: Engine | None = None
        self.results: dict[str, int] = {}
        self.figure = go.FigureWidget(pressure_figure(self._serve(), x))
        for control in (self.budget, self.burst, self.policy):
            control.observe(lambda _change: self.refresh(), names="value")

    def _serve(self) -> Engine:
        requests = stress.burst(self.burst.value, self.max_new_tokens)
        self.engine, outputs = stress.serve_burst(
            self.model,
            requests,
            self.budget.value,
            self.policy.value,
            block_size=self.block_size,
        )
        self.results = stress.burst_summary(self.engine, outputs)
        return self.engine

    def refresh(self) -> None:
        """Serve the burst with the controls' values and redraw."""
        update_pressure_figure(self.figure, self._serve(), self.x)
