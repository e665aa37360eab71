"""Figures for the KV hierarchy (kvlab.cache.tiers): where blocks sit, TTFT by tier, and
recomputed tokens per configuration."""

from __future__ import annotations

import plotly.graph_objects as go

TIER_ROWS = ["device (used)", "device (cached)", "host", "disk"]


def _colors(sessions: list[str]) -> dict[str, str]:
    palette = ["#636efa", "#ef553b", "#00cc96", "#ab63fa", "#ffa15a", "#19d3f3", "#ff6692",
               "#b6e880", "#ff97ff", "#fecb52"]  # fmt: skip
    named = sorted(s for s in sessions if s not in ("-", "shared"))
    colors = {s: palette[i % len(palette)] for i, s in enumerate(named)}
    return colors | {"shared": "#444444", "-": "#bbbbbb"}


def _grid(rows: list[dict]) -> tuple[list[int], list[str], list[str]]:
    """x (position within its tier), y (tier) and session of each block row."""
    seen: dict[str, int] = {}
    xs, ys, names = [], [], []
    for row in sorted(rows, key=lambda r: (TIER_ROWS.index(r["tier"]), r["session"], r["block"])):
        xs.append(seen.get(row["tier"], 0))
        seen[row["tier"]] = xs[-1] + 1
        ys.append(row["tier"])
        names.append(row["session"])
    return xs, ys, names


def hierarchy_figure(frames: list[tuple[str, list[dict]]]) -> go.Figure:
    """Blocks per tier, one square per block coloured by session, with a slider over
    `frames` ((label, experiments.tiers.snapshot rows) recorded as sessions come and go).
    It opens on the frame holding the most blocks (the last is often empty: every session
    ended)."""
    if not frames:
        raise ValueError("frames is empty: record at least one snapshot")
    sessions = sorted({r["session"] for _, rows in frames for r in rows})
    colors = _colors(sessions)

    def traces(rows):
        xs, ys, names = _grid(rows)
        return [go.Scatter(x=xs, y=ys, mode="markers", text=names, hoverinfo="text+y",
                           marker=dict(symbol="square", size=7, color=[colors[n] for n in names]),
                           showlegend=False)]  # fmt: skip

    # One x-range for every frame (an animation keeps the first frame's range): from the
    # first block to the last of the fullest tier in any frame, half a block either side.
    widest = max(max(_grid(rows)[0], default=-1) + 1 for _, rows in frames)
    fullest = max(range(len(frames)), key=lambda i: len(frames[i][1]))  # the first such
    figure = go.Figure(traces(frames[fullest][1]))
    figure.frames = [go.Frame(data=traces(rows), name=label) for label, rows in frames]
    steps = [dict(method="animate", label=label, args=[[label], dict(mode="immediate",
             frame=dict(duration=0, redraw=True))]) for label, _ in frames]  # fmt: skip
    figure.update_layout(
        title="Where each cached block sits (colour: session; grey: none recorded)",
        sliders=[dict(active=fullest, steps=steps, currentvalue=dict(prefix="after "))],
        yaxis=dict(  # every tier's row in every frame, even a tier no frame fills
            categoryorder="array",
            categoryarray=TIER_ROWS[::-1],
            title="",
            range=[-0.5, len(TIER_ROWS) - 0.5],
        ),
        xaxis=dict(title="blocks", range=[-0.5, max(widest, 1) - 0.5], zeroline=False),
        height=360,
        margin=dict(l=120),
    )
    return figure


def ttft_figure(ttft: dict) -> go.Figure:
    """Median TTFT of a follow-up turn by where its history sat (experiments.tiers.ttft_by_tier)."""
    order = ["device", "host", "disk", "recompute"]
    values = [ttft["ttft_median_s"][w] * 1e3 for w in order]
    figure = go.Figure(go.Bar(x=order, y=values, text=[f"{v:.0f} ms" for v in values]))
    figure.update_layout(
        title=f"TTFT of a follow-up turn ({ttft['prompt_tokens']}-token history), "
        f"median of {ttft['repeats']}",
        yaxis_title="ms",
        xaxis_title="where the history's blocks were",
        height=360,
    )
    return figure


def recompute_figure(trace: dict) -> go.Figure:
    """Prompt tokens recomputed per configuration (experiments.tiers.compare_tiering)."""
    names = list(trace["configs"])
    computed = [trace["configs"][n]["computed_tokens"] for n in names]
    figure = go.Figure(go.Bar(x=names, y=computed, text=computed))
    figure.update_layout(
        title=f"Prompt tokens recomputed: {trace['sessions']} sessions, working set "
        f"{trace['working_set_over_pool']:.1f}x the device pool",
        yaxis_title="tokens computed (prefill)",
        height=380,
    )
    return figure


def itl_figure(result: dict) -> go.Figure:
    """Inter-token latency of every decode step, one line per case
    (experiments.tier_decode.decode_itl); rings mark the streamed case's steps that loaded
    a newly arrived request's blocks back from the host tier."""
    rows = [r for r in result["rows"] if r["decode_rows"]]
    figure = go.Figure()
    for case in dict.fromkeys(r["case"] for r in rows):
        mine = [r for r in rows if r["case"] == case]
        figure.add_scatter(x=[r["step"] for r in mine], y=[r["itl_s"] * 1e3 for r in mine],
                           mode="lines+markers", name=case)  # fmt: skip
    loads = [r for r in rows if r["loaded_blocks"]]
    figure.add_scatter(
        x=[r["step"] for r in loads],
        y=[r["itl_s"] * 1e3 for r in loads],
        mode="markers",
        marker=dict(symbol="circle-open", size=16, color="black", line=dict(width=2)),
        text=[f"{r['loaded_blocks']} blocks loaded from host" for r in loads],
        name="streamed: a step that loads blocks",
    )
    figure.update_layout(
        title=f"ITL per decode step ({len(result['prompt_tokens'])} requests, one arriving "
        f"every {result['setup'].stagger} steps)",
        xaxis_title="engine step",
        yaxis_title="inter-token latency (ms)",
        height=380,
    )
    return figure
