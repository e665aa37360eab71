"""The learners' lab notebooks, generated from the one annotated source of each lab.

A lab's only hand-edited copy is its nbgrader source, notebooks/labs/source/<lab>/<lab>.ipynb
(and its jupytext .py): the solved notebook, with nbgrader cell metadata, each reference
solution between `### BEGIN SOLUTION` and `### END SOLUTION` in the exercise cell, and one
locked, autograded test cell per grader check. The student version beside it,
notebooks/labs/<lab>.ipynb (+ .py), is what this module makes of the source; it applies
the steps of nbgrader's `generate_assignment` that change what a learner sees, configured
as in notebooks/labs/nbgrader_config.py (tests/test_labs_nbgrader.py checks that
`nbgrader generate_assignment` makes the same cells):

* ClearSolutions: each solution region becomes `raise NotImplementedError`, indented like
  its BEGIN line (the TODO comments above it stay); a solution cell without a region
  becomes that stub entirely;
* ClearHiddenTests: each `### BEGIN HIDDEN TESTS` ... `### END HIDDEN TESTS` region of a
  grade cell is removed (the source keeps it, and autograde runs it);
* LockCells: grade and locked cells get `editable: false, deletable: false`, the
  solution (exercise) cell `deletable: false`;
* ClearOutput: no outputs, no execution counts.

It skips what only a course's gradebook needs (checksums).

    python -m kvlab.labs.student            # rewrite notebooks/labs/<lab>.ipynb and .py
    python -m kvlab.labs.student --check    # exit 1, naming them, if any is out of date
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
from pathlib import Path

import nbformat

LABS = Path(__file__).resolve().parents[2] / "notebooks" / "labs"
STUB = "raise NotImplementedError"  # c.ClearSolutions.code_stub in nbgrader_config.py
BEGIN, END = "BEGIN SOLUTION", "END SOLUTION"  # nbgrader's delimiters (after "### ")
BEGIN_HIDDEN, END_HIDDEN = "BEGIN HIDDEN TESTS", "END HIDDEN TESTS"


def lab_names(labs: Path = LABS) -> list[str]:
    """The labs that have a source: notebooks/labs/source/<lab>/<lab>.ipynb."""
    return sorted(
        p.parent.name for p in (labs / "source").glob("*/*.ipynb") if p.stem == p.parent.name
    )


def _grading(cell) -> dict:
    return cell.metadata.get("nbgrader", {})


def clear_solutions(source: str, solution_cell: bool) -> str:
    """The cell's source with each solution region replaced by the indented stub."""
    lines, out, inside, replaced = source.split("\n"), [], False, False
    for line in lines:
        if BEGIN in line:
            if inside:
                raise ValueError(f"nested {BEGIN!r} in:\n{source}")
            inside = replaced = True
            out.append(re.match(r"\s*", line).group(0) + STUB)
        elif END in line:
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{BEGIN!r} without {END!r} in:\n{source}")
    if replaced and not solution_cell:
        raise ValueError(f"a solution region outside a solution cell:\n{source}")
    if solution_cell and not replaced:
        return STUB
    return "\n".join(out)


def clear_hidden_tests(source: str, grade_cell: bool) -> str:
    """The cell's source without its hidden-test regions (delimiter lines included)."""
    out, inside, removed = [], False, False
    for line in source.split("\n"):
        if BEGIN_HIDDEN in line:
            if inside:
                raise ValueError(f"nested {BEGIN_HIDDEN!r} in:\n{source}")
            inside = removed = True
        elif END_HIDDEN in line:
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{BEGIN_HIDDEN!r} without {END_HIDDEN!r} in:\n{source}")
    if removed and not grade_cell:
        raise ValueError(f"hidden tests outside a grade cell:\n{source}")
    return "\n".join(out)


def student_version(source: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """The student notebook of a lab source: solutions stubbed, hidden tests removed, graded
    cells locked, no outputs."""
    nb = copy.deepcopy(source)
    nb.metadata.pop("celltoolbar", None)  # nbgrader's "Create Assignment" toolbar
    for cell in nb.cells:
        meta = _grading(cell)
        cell.source = clear_solutions(cell.source, bool(meta.get("solution")))
        cell.source = clear_hidden_tests(cell.source, bool(meta.get("grade")))
        if meta.get("solution"):  # editable, but not deletable
            cell.metadata["deletable"] = False
        elif meta.get("grade") or meta.get("locked"):
            cell.metadata["editable"] = cell.metadata["deletable"] = False
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
            for field in ("collapsed", "scrolled"):
                cell.metadata.pop(field, None)
    return nb


def generate(name: str, labs: Path = LABS) -> tuple[str, str]:
    """The student version of lab `name`: (.ipynb text, jupytext .py text)."""
    import jupytext  # a dev dependency (pip install -e ".[dev]")

    source = nbformat.read(labs / "source" / name / f"{name}.ipynb", as_version=4)
    nb = student_version(source)
    return nbformat.writes(nb) + "\n", without_tool_version(jupytext.writes(nb, fmt="py:percent"))


def without_tool_version(text: str) -> str:
    """jupytext's header without the `jupytext_version:` line: a generated file holds what
    the source says, not which release of the tool wrote it (a new release on PyPI must
    not make the committed copies stale)."""
    return re.sub(r"(?m)^#\s+jupytext_version: .*\n", "", text)


def stale(labs: Path = LABS) -> list[Path]:
    """Student files that differ from what generation makes of the sources now."""
    out = []
    for name in lab_names(labs):
        for path, text in zip((labs / f"{name}.ipynb", labs / f"{name}.py"), generate(name, labs)):
            if not path.exists() or path.read_text() != text:
                out.append(path)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only report out-of-date files")
    parser.add_argument("--labs", type=Path, default=LABS, help="the labs folder")
    args = parser.parse_args(argv)
    if args.check:
        old = stale(args.labs)
        for path in old:
            print(f"out of date: {path} (run python -m kvlab.labs.student)")
        return 1 if old else 0
    for name in lab_names(args.labs):
        for suffix, text in zip((".ipynb", ".py"), generate(name, args.labs)):
            path = args.labs / f"{name}{suffix}"
            path.write_text(text)
            print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
