"""A figure the notebooks' prose quotes from their own run is one their stored outputs show.

In a notebook's markdown, a figure followed by `<!-- out -->` (e.g. `**3.2x**<!-- out -->`
or `23,040<!-- out -->`) is quoted from that notebook's run: it must appear, as written, in
the text of one of the notebook's stored outputs (printed text, a table, a rendered
Markdown output, a plotly figure's labels). nbval then checks that a fresh run prints the
same outputs, so the prose and the run cannot part without a test failing.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = Path(__file__).parents[1] / "notebooks"
NAMES = sorted(p.name for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
QUOTED = re.compile(r"([-+]?[\d][\d,.]*\s?[%x×]?)\**\s*<!-- out -->")


def output_text(nb) -> str:
    """Every stored output's text, joined."""
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if "text" in out:
                parts.append(out["text"])
            for mime, value in out.get("data", {}).items():
                if mime.startswith("text/"):
                    parts.append(value if isinstance(value, str) else "".join(value))
                elif mime.endswith("json"):
                    parts.append(json.dumps(value, ensure_ascii=False))
    return "\n".join(parts)


def quoted_figures(nb) -> list[str]:
    """The figures the markdown marks as quoted from the run."""
    return [
        m.group(1).strip()
        for cell in nb.cells
        if cell.cell_type == "markdown"
        for m in QUOTED.finditer(cell.source)
    ]


@pytest.mark.parametrize("name", NAMES)
def test_quoted_figures_are_in_the_stored_outputs(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    text = output_text(nb)
    missing = [f for f in quoted_figures(nb) if f not in text]
    assert not missing, f"{name}: the prose quotes {missing}, which no stored output shows"


def test_the_marker_finds_figures():
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_markdown_cell("cache **3.2x**<!-- out --> faster, 23,040 <!-- out -->B"),
        nbformat.v4.new_code_cell(outputs=[nbformat.v4.new_output("stream", text="3.2x\n")]),
    ]
    assert quoted_figures(nb) == ["3.2x", "23,040"]
    assert "3.2x" in output_text(nb) and "23,040" not in output_text(nb)
