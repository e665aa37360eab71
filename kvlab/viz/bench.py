"""The figure of `kvlab bench`: output tok/s per system, kvlab coloured, peers grey."""

from __future__ import annotations

import plotly.graph_objects as go

from kvlab.experiments.bench import BenchResult, is_kvlab
from kvlab.viz.style import PEER_COLOR, palette_color


def bench_figure(result: BenchResult) -> go.Figure:
    """Output tok/s per system: kvlab coloured, peers grey, ratios in the title."""
    names = list(result.systems)
    colors = [palette_color(i) if is_kvlab(n) else PEER_COLOR for i, n in enumerate(names)]
    rates = [result.systems[n].tok_s for n in names]
    ratios = ", ".join(f"{k} = {v:.2f}x" for k, v in result.ratios().items())
    fig = go.Figure(go.Bar(x=names, y=rates, marker_color=colors, text=[f"{r:.1f}" for r in rates]))
    fig.update_layout(
        title=f"{result.workload}: output tok/s<br><sup>{ratios}</sup>",
        yaxis_title="output tok/s",
        height=380,
    )
    return fig
