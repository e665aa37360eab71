"""The colours the figures share: the i-th config, system or request is drawn in
`palette_color(i)` in every figure, and a peer (a system kvlab is measured against) grey."""

from __future__ import annotations

from plotly.colors import qualitative

PALETTE = qualitative.Plotly  # 10 colours
PEER_COLOR = "#9e9e9e"


def palette_color(i: int) -> str:
    """The i-th colour of PALETTE, cycling past its end (request id r: palette_color(r))."""
    return PALETTE[i % len(PALETTE)]
