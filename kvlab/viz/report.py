"""Self-contained HTML reports: tables and plotly figures in one file."""

from __future__ import annotations

import html
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go


def write_report(
    path: str | Path,
    title: str,
    note: str,
    tables: dict[str, pd.DataFrame],
    figures: dict[str, go.Figure],
) -> None:
    """One self-contained HTML file: plotly.js is embedded once, then every figure."""
    parts = [
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>",
        "<style>body{font-family:sans-serif;margin:2em} table{border-collapse:collapse}"
        " td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}</style></head><body>",
        f"<h1>{html.escape(title)}</h1><p>{html.escape(note)}</p>",
    ]
    for name, table in tables.items():
        parts += [f"<h2>{html.escape(name)}</h2>", table.to_html()]
    for i, (name, fig) in enumerate(figures.items()):
        parts += [
            f"<h2>{html.escape(name)}</h2>",
            fig.to_html(full_html=False, include_plotlyjs=i == 0),
        ]
    parts.append("</body></html>")
    Path(path).write_text("\n".join(parts), encoding="utf-8")
