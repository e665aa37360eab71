"""nbval's check on a notebook executed elsewhere (tests/nbval_check.py) is nbval's verdict:
equal outputs pass, a changed compared output fails naming its cell, while ignored cells
and sanitized numbers pass as they do under `pytest --nbval`."""

from __future__ import annotations

import copy
from pathlib import Path

import nbformat
from nbval_check import output_differences

NOTEBOOK = Path(__file__).parents[1] / "notebooks" / "01_why_a_kv_cache.ipynb"


def _code_cells(nb) -> list:
    return [cell for cell in nb.cells if cell.cell_type == "code"]


def _first_stdout(nb, ignored: bool):
    """The first code cell printing to stdout, marked NBVAL_IGNORE_OUTPUT or not."""
    for number, cell in enumerate(_code_cells(nb)):
        streams = [o for o in cell.outputs if o.get("name") == "stdout"]
        if streams and ("NBVAL_IGNORE_OUTPUT" in cell.source) == ignored:
            return number, streams[0]
    raise AssertionError(f"{NOTEBOOK.name} has no such cell (ignored={ignored})")


def test_the_committed_outputs_pass_against_themselves(pytestconfig):
    committed = nbformat.read(NOTEBOOK, as_version=4)
    assert output_differences(copy.deepcopy(committed), committed, pytestconfig) == []


def test_a_changed_output_fails_and_names_its_cell(pytestconfig):
    committed = nbformat.read(NOTEBOOK, as_version=4)
    executed = copy.deepcopy(committed)
    number, stream = _first_stdout(executed, ignored=False)
    stream.text = stream.text.replace("\n", " (changed)\n", 1)
    differences = output_differences(executed, committed, pytestconfig)
    assert len(differences) == 1 and differences[0].startswith(f"Cell {number} outputs differ")
    assert "(changed)" in differences[0]


def test_a_missing_output_fails(pytestconfig):
    committed = nbformat.read(NOTEBOOK, as_version=4)
    executed = copy.deepcopy(committed)
    number, _ = _first_stdout(executed, ignored=False)
    _code_cells(executed)[number].outputs = []
    assert len(output_differences(executed, committed, pytestconfig)) == 1


def test_ignored_cells_and_sanitized_timings_pass(pytestconfig):
    committed = nbformat.read(NOTEBOOK, as_version=4)
    executed = copy.deepcopy(committed)
    _, ignored = _first_stdout(executed, ignored=True)
    ignored.text = "anything at all\n"
    _, compared = _first_stdout(executed, ignored=False)
    compared.text += "took 1.25 s\n"  # the reference gets the same line with another time
    _, reference = _first_stdout(committed, ignored=False)
    reference.text += "took 9.5 s\n"
    assert output_differences(executed, committed, pytestconfig) == []


def test_a_different_cell_count_fails(pytestconfig):
    committed = nbformat.read(NOTEBOOK, as_version=4)
    executed = copy.deepcopy(committed)
    executed.cells.append(nbformat.v4.new_code_cell("print(1)"))
    assert "code cells ran" in output_differences(executed, committed, pytestconfig)[0]
