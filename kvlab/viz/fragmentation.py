"""Notebook 02's picture of external fragmentation: the address range at the moment a
contiguous allocator refuses a request that the free total could hold, beside the paged
allocator admitting it."""

from __future__ import annotations

import plotly.graph_objects as go

from kvlab.experiments.fragmentation import Refusal
from kvlab.viz.style import palette_color

FREE_COLOR = "#e0e0e0"


def _runs(owners: list[int]) -> list[tuple[int, int, int]]:
    """Consecutive blocks with the same owner: (owner, start, size), address order."""
    runs: list[tuple[int, int, int]] = []
    for block, owner in enumerate(owners):
        if runs and runs[-1][0] == owner and runs[-1][1] + runs[-1][2] == block:
            runs[-1] = (owner, runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((owner, block, 1))
    return runs


def refusal_strip(refusal: Refusal, block_size: int) -> go.Figure:
    """Three strips over the same address range: the refused request's need laid over the
    largest hole (it runs past the hole's end), the contiguous layout (regions and holes)
    that refused it, and the paged pool that admitted it (its blocks hatched, wherever they
    lie). A bar is a run of blocks; hover names it."""
    r = refusal
    hole_start = next(start for start, size in r.holes if size == r.largest_hole)
    rows = (
        f"request {r.request}'s need, at the largest hole",
        "contiguous (first fit): refused",
        "paged (BlockAllocator): admitted",
    )
    fig, shown = go.Figure(), set()

    def bar(row: str, owner: int, start: int, size: int, text: str) -> None:
        new, free = owner == r.request, owner < 0
        name = "free" if free else f"request {owner}" + (f" (needs {r.need})" if new else "")
        fig.add_bar(
            y=[row],
            x=[size],
            base=[start],
            orientation="h",
            name=name,
            legendgroup=name,
            showlegend=name not in shown,
            marker=dict(
                color=FREE_COLOR if free else palette_color(owner),
                line=dict(color="black" if new else "white", width=1),
                pattern=dict(shape="/" if new else ""),
            ),
            text=text,
            textposition="inside",
            insidetextanchor="middle",
            hovertemplate=f"{text}: blocks {start}-{start + size - 1}<extra></extra>",
        )
        shown.add(name)

    bar(rows[0], r.request, hole_start, r.need, f"needs {r.need}")
    layout = [(owner, *region) for owner, region in r.regions.items()]
    layout += [(-1, start, size) for start, size in r.holes]
    for owner, start, size in sorted(layout, key=lambda x: x[1]):
        bar(rows[1], owner, start, size, f"hole {size}" if owner < 0 else f"request {owner}")
    for owner, start, size in _runs(r.paged_owners):
        bar(rows[2], owner, start, size, "free" if owner < 0 else f"request {owner}")
    fig.update_layout(
        barmode="overlay",
        title=(
            f"step {r.step}: request {r.request} needs {r.need} blocks; {r.free_total} are "
            f"free in total, the largest hole has {r.largest_hole}<br><sup>contiguous: no "
            "hole is large enough, so it waits; paged: any free blocks will do</sup>"
        ),
        xaxis=dict(
            title=f"address: block index ({block_size} token slots each)",
            range=[0, max(len(r.paged_owners), hole_start + r.need)],
        ),
        yaxis=dict(categoryorder="array", categoryarray=list(reversed(rows))),
        legend=dict(title="owner"),
        height=320,
        margin=dict(l=10, r=10, t=70, b=40),
        uniformtext=dict(minsize=9, mode="hide"),
    )
    return fig
