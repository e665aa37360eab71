"""The figure of `kvlab bench`: output tok/s per system, kvlab coloured, peers grey."""

from __future__ import annotations

import plotly.graph_objects as go

from kvlab.experiments.bench import BenchResult, is_kvlab
from kvlab.viz.style import PEER_COLOR, palette_color


def bench_figure(result: BenchResult) -> go.Figure:
    """Median output tok/s per system (kvlab coloured, peers grey), a whisker up to its
    fastest round and down to its slowest; the median ratios in the title."""
    names = list(result.systems)
    systems = [result.systems[n] for n in names]
    colors = [palette_color(i) if is_kvlab(n) else PEER_COLOR for i, n in enumerate(names)]
    rates = [s.median_tok_s for s in systems]
    fastest = [s.tok_s - r for s, r in zip(systems, rates)]
    slowest = [r - s.output_tokens / max(s.walls_s or [s.wall_s]) for s, r in zip(systems, rates)]
    ratios = ", ".join(f"{k} = {v:.2f}x" for k, v in result.median_ratios().items())
    rounds = max(len(s.walls_s or [s.wall_s]) for s in systems)
    fig = go.Figure(
        go.Bar(
            x=names,
            y=rates,
            marker_color=colors,
            text=[f"{r:.1f}" for r in rates],
            error_y={"type": "data", "symmetric": False, "array": fastest, "arrayminus": slowest},
        )
    )
    title = f"{result.workload}: output tok/s, median of {rounds} round(s)"
    fig.update_layout(
        title=f"{title}<br><sup>{ratios}</sup>",
        yaxis_title="output tok/s (whiskers: fastest and slowest rounds)",
        height=380,
    )
    return fig
