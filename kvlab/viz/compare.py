"""The figures of `kvlab compare`: memory over time, capacity, throughput and latency.

Each add_* draws into a figure cell, so the same traces serve the standalone figures and
the dashboard's subplot grid.
"""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvlab.experiments.compare import Comparison
from kvlab.units import MiB
from kvlab.viz.style import PEER_COLOR, palette_color


def comparison_figures(
    comparison: Comparison, peers: dict[str, float] | None = None, x: str = "time_s"
) -> dict[str, go.Figure]:
    """Standalone figures: memory over time, capacity, throughput and latency.

    `peers`: extra throughput bars {name: tok/s} (e.g. from a saved bench), grey.
    `x`: the memory figure's axis, "time_s" (seconds) or "step" (engine steps: the same on
    every machine).
    """
    return {
        "memory": memory_over_time(comparison, x),
        "capacity": _single(add_capacity, comparison, "Peak concurrent sequences and waste"),
        "throughput": _single(add_throughput, comparison, "Throughput", peers),
        "latency": _single(add_latency, comparison, "Latency"),
    }


def _single(add, comparison: Comparison, title: str, *args) -> go.Figure:
    fig = go.Figure()
    add(fig, comparison, *args)
    fig.update_layout(title=title, height=380, barmode="group")
    return fig


def _cell(row: int | None, col: int | None) -> dict:
    return {} if row is None else {"row": row, "col": col}


AXES = {"time_s": "seconds", "step": "engine step"}


def _axis(stats, x: str):
    """The x values of a run's steps: seconds from its first step, or step numbers."""
    if x not in AXES:
        raise ValueError(f"x={x!r}: choose one of {list(AXES)}")
    return stats[x] - stats[x].min() + (1 if x == "step" else 0)


def add_memory(
    fig: go.Figure, comparison: Comparison, row=None, col=None, x: str = "time_s"
) -> None:
    """Reserved (solid) and live (dotted) KV MiB against seconds (or engine steps, `x`),
    a colour per config, and the budget (dashed)."""
    cell, end = _cell(row, col), 0.0
    for i, (name, run) in enumerate(comparison.runs.items()):
        color, stats = palette_color(i), run.stats
        t = _axis(stats, x)
        end = max(end, float(t.max()) if len(stats) else 0)
        for column, dash, label in (
            ("reserved_bytes", "solid", "reserved"),
            ("live_bytes", "dot", "live"),
        ):
            fig.add_scatter(
                x=t,
                y=stats[column] / MiB,
                name=f"{name} {label}",
                legendgroup=name,
                line=dict(color=color, dash=dash),
                **cell,
            )
    budget = comparison.budget_bytes / MiB
    fig.add_scatter(
        x=[0, end],
        y=[budget, budget],
        name="KV budget",
        mode="lines",
        line=dict(color="black", dash="dash", width=1),
        **cell,
    )
    fig.update_xaxes(title_text=AXES[x], **cell)
    fig.update_yaxes(title_text="KV MiB", rangemode="tozero", **cell)


def memory_over_time(comparison: Comparison, x: str = "time_s") -> go.Figure:
    """KV memory over time (top) and running sequences (bottom), a colour per config;
    `x`: "time_s" (seconds) or "step" (engine steps)."""
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.65, 0.35])
    add_memory(fig, comparison, 1, 1, x)
    for i, (name, run) in enumerate(comparison.runs.items()):
        stats = run.stats
        fig.add_scatter(
            x=_axis(stats, x),
            y=stats["running"],
            name=f"{name} running",
            legendgroup=name,
            showlegend=False,
            line=dict(color=palette_color(i), shape="hv"),
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
        marker_color=[palette_color(i) for i in range(len(names))],
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
        marker_color=[palette_color(i) for i in range(len(names))],
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
