"""Notebook 06's figures: how the decode kernel walks the block table, and a roofline."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvlab.kernels import walk
from kvlab.units import ceil_div, round_up
from kvlab.viz.style import palette_color


def block_walk_figure(
    block_tables: list[list[int]],
    context_lens: list[int],
    block_size: int,
    tile: int,
    num_splits: int = 1,
    num_blocks: int | None = None,
) -> go.Figure:
    """Top: each sequence's context positions as the kernel's programs see them (one
    colour per sequence, darker for odd tiles, a gap between splits); the label is the
    physical block each position is read from. Bottom: the pool's physical blocks, each
    slot labelled with the (sequence, position) it holds; free slots are blank."""
    rows = pd.DataFrame(walk(block_tables, context_lens, block_size, tile, num_splits))
    num_blocks = num_blocks or max(max(t) for t in block_tables) + 1
    span = max(context_lens)
    fig = make_subplots(
        rows=2,
        cols=1,
        vertical_spacing=0.2,
        row_heights=[0.35, 0.65],
        subplot_titles=(
            f"logical: position p -> block table[p // {block_size}] "
            f"(program per sequence x split, {tile} positions per tile)",
            f"physical pool: slot = block x {block_size} + p % {block_size}",
        ),
    )
    for b, seq in rows.groupby("seq"):
        colour = palette_color(b)
        shade = [0.55 if t % 2 else 1.0 for t in seq["tile"]]
        fig.add_trace(
            go.Scatter(
                x=seq["pos"],
                y=[f"seq {b}"] * len(seq),
                mode="markers+text",
                marker=dict(symbol="square", size=22, color=colour, opacity=shade),
                text=[f"b{blk}" for blk in seq["block"]],
                textfont=dict(size=9, color="white"),
                customdata=seq[["split", "tile", "block", "slot"]],
                hovertemplate="pos %{x}: split %{customdata[0]}, tile %{customdata[1]}, "
                "block %{customdata[2]}, slot %{customdata[3]}<extra></extra>",
                name=f"seq {b}",
                legendgroup=f"seq {b}",
            ),
            row=1,
            col=1,
        )
        fig.add_trace(
            go.Scatter(
                x=seq["slot"] % block_size,
                y=[f"block {blk}" for blk in seq["block"]],
                mode="markers+text",
                marker=dict(symbol="square", size=26, color=colour),
                text=[f"{b}:{p}" for p in seq["pos"]],
                textfont=dict(size=9, color="white"),
                hovertemplate="slot %{customdata}<extra></extra>",
                customdata=seq["slot"],
                showlegend=False,
                legendgroup=f"seq {b}",
            ),
            row=2,
            col=1,
        )
    # where one program's chunk ends and the next's begins (walk's chunk)
    chunk = round_up(ceil_div(max(len(t) for t in block_tables) * block_size, num_splits), tile)
    for split in range(1, num_splits):
        if split * chunk < span:
            fig.add_vline(x=split * chunk - 0.5, line_dash="dash", line_color="grey", row=1, col=1)
    blocks = [f"block {i}" for i in range(num_blocks)]  # every block, free ones too
    fig.update_yaxes(
        categoryorder="array", categoryarray=blocks, range=[num_blocks - 0.5, -0.5], row=2, col=1
    )
    fig.update_yaxes(autorange="reversed", row=1, col=1)
    fig.update_xaxes(title_text="context position p", dtick=block_size, row=1, col=1)
    fig.update_xaxes(
        title_text="offset in block", dtick=1, range=[-0.5, block_size - 0.5], row=2, col=1
    )
    fig.update_layout(height=300 + 28 * num_blocks, margin=dict(t=60, l=80, r=20, b=40))
    return fig


def roofline_figure(points: pd.DataFrame, copy_gb_s: float, title: str) -> go.Figure:
    """Time vs bytes moved, log-log, one colour per `series`; the dashed line is the time
    the same bytes take at the measured copy bandwidth (the memory roofline).

    points: columns bytes, ms, series (and optionally context, batch for the hover).
    """
    fig = go.Figure()
    for i, (series, group) in enumerate(points.groupby("series", sort=False)):
        hover = [
            f"context {c}, batch {b}"
            for c, b in zip(group.get("context", ""), group.get("batch", ""))
        ]
        fig.add_trace(
            go.Scatter(
                x=group["bytes"],
                y=group["ms"],
                mode="markers",
                name=series,
                marker=dict(color=palette_color(i), size=8),
                text=hover,
                hovertemplate="%{text}<br>%{x:.3s}B in %{y:.3g} ms<extra>%{fullData.name}</extra>",
            )
        )
    lo, hi = points["bytes"].min() / 2, points["bytes"].max() * 2
    fig.add_trace(
        go.Scatter(
            x=[lo, hi],
            y=[lo / copy_gb_s / 1e6, hi / copy_gb_s / 1e6],
            mode="lines",
            line=dict(dash="dash", color="black"),
            name=f"copy bandwidth {copy_gb_s:.3g} GB/s",
        )
    )
    fig.update_xaxes(type="log", title_text="bytes a decode step must read (K, V, scales)")
    fig.update_yaxes(type="log", title_text="time per call (ms)")
    fig.update_layout(title=title, height=450, margin=dict(t=60, l=60, r=20, b=50))
    return fig
