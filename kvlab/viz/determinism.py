"""Figures for notebook 15: where answers part from their run alone, and what the fix costs."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from kvlab.viz.style import palette_color


def drift_figure(frame: pd.DataFrame, title: str) -> go.Figure:
    """Prompts (rows) x settings (columns) of a kvlab.experiments.determinism.drift frame:
    colour = the share of a prompt's steps whose logits are not the bits of its run
    alone; text = the token where its answer parts ("same" where it never does)."""
    frame = frame.assign(changed=1 - frame["bit_exact"] / frame["steps"])
    grid = frame.pivot(index="prompt", columns="setting", values="changed")
    grid = grid[list(dict.fromkeys(frame["setting"]))]  # settings in the order run
    parts = frame.pivot(index="prompt", columns="setting", values="parts_at")[grid.columns]
    text = parts.map(lambda x: "same" if pd.isna(x) else f"parts at {int(x)}")
    fig = go.Figure(
        go.Heatmap(
            z=grid.to_numpy(),
            x=list(grid.columns),
            y=[f"prompt {p}" for p in grid.index],
            text=text.to_numpy(),
            texttemplate="%{text}",
            zmin=0,
            zmax=1,
            colorscale="Reds",
            colorbar={"title": "steps with<br>other bits"},
        )
    )
    fig.update_layout(title=title, height=120 + 40 * len(grid), yaxis_autorange="reversed")
    return fig


def cost_figure(saved: dict) -> go.Figure:
    """Median output tok/s per system and workload, whiskers from the slowest to the
    fastest round, from benchmarks/batch_invariant.py's JSON (stamped: its provenance)."""
    fig, where = go.Figure(), saved.get("provenance", {})
    systems = list(next(iter(saved["workloads"].values()))["systems"])
    for index, name in enumerate(systems):
        rows = [run["systems"][name] for run in saved["workloads"].values()]
        median = [row["tok_s_median"] for row in rows]
        fig.add_bar(
            name=name,
            x=list(saved["workloads"]),
            y=median,
            marker_color=palette_color(index),
            error_y={
                "type": "data",
                "symmetric": False,
                "array": [row["tok_s_max"] - m for row, m in zip(rows, median)],
                "arrayminus": [m - row["tok_s_min"] for row, m in zip(rows, median)],
            },
        )
    fig.update_layout(
        barmode="group",
        title=f"Output tok/s, median of {saved['rounds']} alternating rounds<br>"
        f"<sup>{where.get('machine', saved['machine'])}, {where.get('date', '')}</sup>",
        yaxis_title="output tok/s",
        height=400,
    )
    return fig
