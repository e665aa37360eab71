"""nbval's output check, applied to a notebook that another runner executed.

`make test` runs each top-level notebook once, in JupyterLab (tests/test_browser.py), and
checks what the browser saved against the committed outputs exactly as
`pytest --nbval --nbval-sanitize-with notebooks/sanitize.cfg` does: nbval's own comparison
code (streams coalesced, widget model ids and metadata skipped, images skipped), its cell
markers (NBVAL_IGNORE_OUTPUT, NBVAL_SKIP, ... as comments or tags) and the sanitize
patterns. tests/conftest.py then leaves out nbval's own run of those notebooks, which would
execute each a second time.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from pathlib import Path

import nbformat
from nbval import plugin

SANITIZE = Path(__file__).parents[1] / "notebooks" / "sanitize.cfg"
# What nbval leaves out of a comparison when run without --nbdime (IPyNbFile.skip_compare).
SKIP_COMPARE = (
    "metadata",
    "traceback",
    "prompt_number",
    "output_type",
    "name",
    "execution_count",
    "application/vnd.jupyter.widget-view+json",
    "image/png",
    "image/jpeg",
)


class _NbvalNotebook:
    """The two things an nbval cell reads from its notebook: patterns and skipped keys."""

    def __init__(self, sanitize: Path):
        self.sanitize_patterns = OrderedDict(plugin.get_sanitize_patterns(sanitize.read_text()))
        self.skip_compare = SKIP_COMPARE


class _NbvalCell:
    """Just enough of nbval's IPyNbCell to run its comparison methods unchanged."""

    compare_outputs = plugin.IPyNbCell.compare_outputs
    format_output_compare = plugin.IPyNbCell.format_output_compare
    sanitize = plugin.IPyNbCell.sanitize
    colors = plugin.nocolors

    def __init__(self, parent: _NbvalNotebook, config):
        self.parent, self.config, self.ihook = parent, config, config.hook
        self.comparison_traceback: list[str] = []


def _options(cell) -> dict:
    """nbval's options for a cell: its metadata tags, then its comment markers."""
    options = defaultdict(bool, plugin.find_metadata_tags(cell.metadata))
    options.update(dict(plugin.find_comment_markers(cell.source)))
    options.setdefault("check", True)
    return options


def output_differences(
    executed: nbformat.NotebookNode,
    reference: nbformat.NotebookNode,
    config,
    sanitize: Path = SANITIZE,
) -> list[str]:
    """nbval's verdict on each code cell of `executed` against `reference`: one message per
    cell whose outputs differ (empty when nbval would pass them all). `config` is pytest's."""
    notebook = _NbvalNotebook(sanitize)
    ran = [c for c in executed.cells if c.cell_type == "code"]
    stored = [c for c in reference.cells if c.cell_type == "code"]
    if len(ran) != len(stored):
        return [f"{len(ran)} code cells ran, the committed notebook has {len(stored)}"]
    differences = []
    for number, (test, ref) in enumerate(zip(ran, stored)):
        options = _options(ref)
        if options["skip"] or not options["check"] or ref.execution_count is None:
            continue
        cell = _NbvalCell(notebook, config)
        outputs = [nbformat.from_dict(o) for o in test.outputs]
        references = [nbformat.from_dict(o) for o in ref.outputs]
        same = cell.compare_outputs(
            plugin.coalesce_streams(outputs), plugin.coalesce_streams(references)
        )
        if not same:
            detail = "\n".join(cell.comparison_traceback)
            differences.append(f"Cell {number} outputs differ:\n{ref.source[:300]}\n{detail}")
    return differences
