"""Notebook 11's figures: the block map as a window slides, KV memory held against
context length per retention policy, and recall against the KV kept."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from kvlab.units import MiB

STATES = {"not yet": 0, "kept": 1, "dropped": 2}
COLORS = [[0, "#f2f2f2"], [0.5, "#2b8cbe"], [1, "#fdae6b"]]
ROW_PX_FOR_TEXT = 16  # rows of the block map shorter than this on screen carry no numbers


def block_map_figure(trace: pd.DataFrame, title: str = "") -> go.Figure:
    """Rows = steps, columns = logical blocks of one sequence: blue kept, orange dropped,
    grey not written yet (`kvlab.experiments.longctx.table_trace`).

    A row is as tall as the tokens its step added (a 32-token prefill chunk is tall, a
    decode step one token thin), so the physical block numbers are written only in rows
    tall enough to read them (ROW_PX_FOR_TEXT); hovering any cell names its block."""
    steps, width = int(trace["step"].max()), int(trace["logical"].max()) + 1
    z = [[0] * width for _ in range(steps)]
    numbers = [[""] * width for _ in range(steps)]
    hover = [["not written yet"] * width for _ in range(steps)]
    for row in trace.itertuples():
        z[row.step - 1][row.logical] = STATES[row.state]
        kept = row.state != "dropped"
        numbers[row.step - 1][row.logical] = str(row.physical) if kept else ""
        hover[row.step - 1][row.logical] = f"physical block {row.physical}" if kept else "dropped"
    tokens = trace.groupby("step")["tokens"].first().tolist()
    height, margin = 420, dict(t=70, b=60)
    # Row edges as plotly draws them: half-way between neighbours, half a gap past the ends.
    if len(tokens) > 1:
        mids = [(a + b) / 2 for a, b in zip(tokens, tokens[1:])]
        edges = [1.5 * tokens[0] - 0.5 * tokens[1], *mids, 1.5 * tokens[-1] - 0.5 * tokens[-2]]
    else:
        edges = [tokens[0] - 0.5, tokens[0] + 0.5]
    px_per_token = (height - margin["t"] - margin["b"]) / (edges[-1] - edges[0])
    text = [
        row if (edges[i + 1] - edges[i]) * px_per_token >= ROW_PX_FOR_TEXT else [""] * width
        for i, row in enumerate(numbers)
    ]
    figure = go.Figure(
        go.Heatmap(
            z=z,
            text=text,
            texttemplate="%{text}",
            textfont=dict(size=12),  # fixed: "auto" sizes every number to the thinnest row
            customdata=hover,
            colorscale=COLORS,
            zmin=0,
            zmax=2,
            showscale=False,
            y=tokens,
            hovertemplate="logical block %{x}: %{customdata}<br>%{y} tokens<extra></extra>",
        )
    )
    figure.update_layout(
        title=title or "Block table after each step (number: physical block; orange: dropped)",
        xaxis_title="logical block",
        yaxis_title="tokens in the cache (after the step)",
        yaxis_autorange="reversed",
        height=height,
        margin=margin,
    )
    return figure


def memory_figure(trace: pd.DataFrame) -> go.Figure:
    """KV memory a sequence holds (MiB, after retention) against the tokens fed, per policy
    (the trace of `kvlab.experiments.longctx.perplexity_table`)."""
    figure = go.Figure()
    for policy, rows in trace.groupby("policy", sort=False):
        figure.add_scatter(x=rows["tokens"], y=rows["kv_bytes"] / MiB, name=policy, mode="lines")
    figure.update_layout(
        title="KV memory held vs context length",
        xaxis_title="tokens of context",
        yaxis_title="KV held (MiB)",
        height=380,
    )
    return figure


def recall_frontier_figure(frontier: pd.DataFrame) -> go.Figure:
    """Needle recall against the fraction of the full KV kept, one line per policy
    (`kvlab.experiments.longctx.recall_frontier`); full retention is the point at 1."""
    summary = (
        frontier.groupby(["policy", "budget"], sort=False)
        .agg(recall=("recalled", "mean"), kept=("kv_kept_frac", "mean"))
        .reset_index()
    )
    figure = go.Figure()
    for policy, rows in summary.groupby("policy", sort=False):
        figure.add_scatter(
            x=rows["kept"],
            y=rows["recall"],
            name=policy,
            mode="lines+markers",
            text=[f"budget {b:.0%}" for b in rows["budget"]],
        )
    figure.update_layout(
        title="Needle recall vs KV kept",
        xaxis_title="KV held at peak / KV of the full context",
        yaxis_title="recall (fraction of needles)",
        yaxis_range=[-0.05, 1.05],
        height=380,
    )
    return figure
