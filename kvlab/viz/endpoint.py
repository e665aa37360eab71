"""The figure of `kvlab replay`: one workload against one or more OpenAI-compatible
servers (kvlab serve, vllm serve), as their own /metrics pages showed it live (KV-cache
usage, running and waiting requests, sampled while the run went on) and as the client
timed it (TTFT and inter-token gaps)."""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvlab.serve.replay import ReplayResult
from kvlab.viz.style import palette_color


def endpoint_figure(results: dict[str, ReplayResult]) -> go.Figure:
    """Per server (one colour each): KV-cache usage and running/waiting over time from its
    /metrics, then box plots of TTFT and inter-token latency (client clock)."""
    titles = ["KV-cache usage (its /metrics)", "running (solid) / waiting (dotted)"]
    titles += ["TTFT (s)", "inter-token gap (s)"]
    fig = make_subplots(rows=2, cols=2, subplot_titles=titles, vertical_spacing=0.15)
    for i, (name, result) in enumerate(results.items()):
        color = palette_color(i)
        t = [s["t_s"] for s in result.samples]
        usage = [s["vllm:kv_cache_usage_perc"] for s in result.samples]
        row = result.summary()
        label = f"{name} (hit rate {row['prefix_hit_rate']})"
        fig.add_trace(
            go.Scatter(x=t, y=usage, name=label, line_color=color, legendgroup=name), 1, 1
        )
        for series, dash in (
            ("vllm:num_requests_running", None),
            ("vllm:num_requests_waiting", "dot"),
        ):
            values = [s[series] for s in result.samples]
            line = {"color": color, "dash": dash}
            trace = go.Scatter(x=t, y=values, line=line, legendgroup=name, showlegend=False)
            fig.add_trace(trace, 1, 2)
        ttft = [r.ttft_s for r in result.requests]
        gaps = [g for r in result.requests for g in r.gaps_s]
        box = {"marker_color": color, "legendgroup": name, "showlegend": False, "name": name}
        fig.add_trace(go.Box(y=ttft, **box), 2, 1)
        fig.add_trace(go.Box(y=gaps, **box), 2, 2)
    fig.update_xaxes(title_text="seconds since the first request", row=1)
    fig.update_yaxes(range=[0, 1.05], row=1, col=1)
    fig.update_layout(height=640, title="one workload, several servers: their /metrics, live")
    return fig
