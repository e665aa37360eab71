"""Figures for notebook 13: the first-token times of an attacker's right and wrong guesses,
with the shared cache and with per-tenant salts."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

GUESS_COLORS = {"right": "#ef553b", "wrong": "#636efa"}


def attack_figure(frames: dict[str, pd.DataFrame]) -> go.Figure:
    """One panel per setting: each probe's TTFT by guess (points over a box), and the
    attacker's threshold (a dashed line): below it the attacker says "cached"."""
    fig = make_subplots(rows=1, cols=len(frames), subplot_titles=list(frames), shared_yaxes=True)
    for col, frame in enumerate(frames.values(), start=1):
        for guess, color in GUESS_COLORS.items():
            times = frame.loc[frame["guess"] == guess, "ttft_s"] * 1000
            fig.add_trace(
                go.Box(y=times, name=f"{guess} guess", marker_color=color, boxpoints="all",
                       jitter=0.4, pointpos=0, legendgroup=guess, showlegend=col == 1),
                row=1, col=col,
            )  # fmt: skip
        fig.add_hline(
            y=frame.attrs["threshold_s"] * 1000, line_dash="dash", line_color="#444",
            annotation_text="threshold", row=1, col=col,
        )  # fmt: skip
    fig.update_yaxes(type="log")
    fig.update_yaxes(title_text="time to first token (ms)", row=1, col=1)
    fig.update_layout(
        title="Does the attacker's guess hit the victim's cached prompt? (first-token time)",
        height=420, width=900, boxmode="group",
    )  # fmt: skip
    return fig
