"""Speculative decoding drawn: a block table through draft -> verify -> rollback, and the
measurements of kvlab.experiments.speculative.

- `describe_event`, `slot_states`: one verified row (a kvlab.speculative.speculator.SpecEvent)
  as a line of text and as the state of every slot at the table's tail.
- `rollback_animation`: plotly frames, two per event: while verifying (the pending
  token and the drafts hold slots, some in blocks allocated for them) and after the
  rollback (rejected drafts' slots forgotten, blocks holding only them returned).
- `k_figure`: decode speed-up, tokens per target forward and acceptance against k.
- `batch_figure`: decode tok/s with and without drafts as the batch grows.
"""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvlab.speculative.speculator import SpecEvent

# Slot states, in the colour scale's order.
STATES = ("empty", "verified", "pending", "accepted draft", "rejected draft", "returned")
COLORS = ("#f0f0f0", "#9ecae1", "#3182bd", "#31a354", "#de2d26", "#fdd0a2")


def describe_event(e: SpecEvent) -> str:
    """'step 7 · request 0 · pos 1702: 4 drafts, 2 accepted · table ..[113, 114] ->
    ..[113]' (the table's last two blocks during verification and after rollback)."""
    during, after = e.table[-2:], e.kept[-2:]
    return (
        f"step {e.step} · request {e.request_id} · pos {e.position}: {len(e.drafts)} drafts, "
        f"{e.accepted} accepted · table ..{during} -> ..{after}"
    )


def slot_states(e: SpecEvent, block_size: int, rows: int, after: bool) -> list[list[int]]:
    """(rows, block_size) state codes (indices into STATES) of the table's last `rows`
    logical blocks of the verify table, during verification or after the rollback."""
    first = max(0, len(e.table) - rows)
    grid = []
    for j in range(first, first + rows):
        row = []
        for s in range(block_size):
            pos = j * block_size + s
            offset = pos - e.position
            if j >= len(e.table):
                state = "empty"
            elif after and j >= len(e.kept):
                state = "returned"
            elif offset < 0:
                state = "verified"
            elif offset == 0:
                state = "verified" if after else "pending"
            elif offset <= e.accepted:
                state = "verified" if after else "accepted draft"
            elif offset <= len(e.drafts):
                state = "empty" if after else "rejected draft"
            else:
                state = "empty"
            row.append(STATES.index(state))
        grid.append(row)
    return grid


def _labels(e: SpecEvent, rows: int, after: bool) -> list[str]:
    first = max(0, len(e.table) - rows)
    labels = []
    for j in range(first, first + rows):
        if j >= len(e.table):
            labels.append(f"logical {j}: -")
        elif after and j >= len(e.kept):
            labels.append(f"logical {j}: page {e.table[j]} returned")
        else:
            labels.append(f"logical {j} -> page {e.table[j]}")
    return labels


def rollback_animation(events: list[SpecEvent], block_size: int, rows: int = 3) -> go.Figure:
    """The last `rows` logical blocks of a request's table, two frames per event:
    "verify" (pending token + drafts computed in one forward) and "rollback"."""
    if not events:
        raise ValueError("rollback_animation needs at least one SpecEvent")
    scale = [[i / (len(COLORS) - 1), c] for i, c in enumerate(COLORS)]
    frames = []
    for i, e in enumerate(events):
        for after in (False, True):
            phase = "rollback" if after else "verify"
            z = slot_states(e, block_size, rows, after)
            heat = go.Heatmap(
                z=z,
                x=[f"slot {s}" for s in range(block_size)],
                y=[f"tail {r}" for r in range(rows)],
                text=[[STATES[c] for c in row] for row in z],
                hovertemplate="%{y} %{x}: %{text}<extra></extra>",
                zmin=0,
                zmax=len(STATES) - 1,
                colorscale=scale,
                showscale=False,
                xgap=2,
                ygap=2,
            )
            title = (
                f"step {e.step} · {phase}: {len(e.drafts)} drafts at positions "
                f"{e.position + 1}..{e.position + len(e.drafts)}, {e.accepted} accepted<br>"
                + " | ".join(_labels(e, rows, after))
            )
            frames.append(go.Frame(data=[heat], name=f"{i}-{phase}", layout={"title": title}))
    fig = go.Figure(data=frames[0].data, frames=frames, layout={"title": frames[0].layout.title})
    for state, color in zip(STATES, COLORS):  # a legend for the colours
        marker = {"color": color, "size": 12, "symbol": "square"}
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=state, marker=marker))
    steps = [
        {"label": f.name, "method": "animate",
         "args": [[f.name], {"mode": "immediate", "frame": {"duration": 0, "redraw": True}}]}
        for f in frames
    ]  # fmt: skip
    play = {"frame": {"duration": 700, "redraw": True}, "fromcurrent": True}
    fig.update_layout(
        height=330,
        margin={"t": 90},
        sliders=[{"steps": steps, "currentvalue": {"prefix": "frame "}}],
        updatemenus=[{"type": "buttons", "showactive": False, "x": 0, "y": -0.25,
                      "buttons": [{"label": "play", "method": "animate", "args": [None, play]}]}],
    )  # fmt: skip
    fig.update_yaxes(autorange="reversed")
    return fig


def k_figure(frame: pd.DataFrame) -> go.Figure:
    """Against k (batch-1 runs of `SpecResult.frame()`): decode speed-up over no
    speculation, output tokens per target forward, and acceptance; one line per system,
    method and workload."""
    runs = frame[(frame.part == "k") & (frame.method != "none")]
    fig = make_subplots(1, 3, subplot_titles=("decode speed-up", "tokens per target forward",
                                              "acceptance rate"))  # fmt: skip
    for (system, method, workload), group in runs.groupby(["system", "method", "workload"]):
        group = group.sort_values("k")
        name = f"{system} {method} · {workload}"
        dash = "solid" if workload == "doc-qa" else "dot"
        for col, column in enumerate(("decode_speedup", "tokens_per_forward", "acceptance_rate")):
            fig.add_trace(
                go.Scatter(x=group.k, y=group[column], name=name, legendgroup=name,
                           showlegend=col == 0, mode="lines+markers", line={"dash": dash}),
                1, col + 1,
            )  # fmt: skip
    fig.add_hline(y=1.0, line={"color": "grey", "dash": "dash"}, row=1, col=1)
    fig.update_xaxes(title_text="k (drafts per step)")
    fig.update_layout(height=380)
    return fig


def batch_figure(frame: pd.DataFrame) -> go.Figure:
    """The batch-size sweep: decode tok/s without and with drafts, and the speed-up."""
    runs = frame[frame.part == "batch"]
    fig = make_subplots(1, 2, subplot_titles=("decode tok/s", "speed-up with drafts"))
    for method, group in runs.groupby("method"):
        name = "no speculation" if method == "none" else f"{method} k={group.k.iloc[0]}"
        fig.add_trace(go.Scatter(x=group.batch_size, y=group.decode_tok_s, name=name,
                                 mode="lines+markers"), 1, 1)  # fmt: skip
    spec = runs[runs.method != "none"]
    fig.add_trace(go.Scatter(x=spec.batch_size, y=spec.decode_speedup, name="speed-up",
                             mode="lines+markers"), 1, 2)  # fmt: skip
    fig.add_hline(y=1.0, line={"color": "grey", "dash": "dash"}, row=1, col=2)
    fig.update_xaxes(title_text="batch size", type="log")
    fig.update_layout(height=360)
    return fig
