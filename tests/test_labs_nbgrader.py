"""nbgrader grades kvlab's labs: the whole course workflow on a throw-away course directory.

For each lab: `generate_assignment` on its source (notebooks/labs/source/<lab>/<lab>.ipynb)
with notebooks/labs/nbgrader_config.py must make exactly the committed student notebook;
`autograde` then grades known-wrong answers from tests/lab_mistakes.py (each loses the
points of the checks it fails, visible or hidden, keeps those of the checks it passes, and
its feedback page shows kvlab's report of the broken invariant, never the hidden tests)
and, with KVLAB_NBGRADER_ALL=1, a solved submission (full marks) and the untouched student
version (0, every check cell saying "not implemented yet"). `make test` runs the solved
sources, hidden tests included, under nbval and tests/test_labs.py, and the committed
student notebooks in tests/test_labs.py.

nbgrader is the optional `grading` extra, installed by `make test-grading` in its own venv
(.venv-grading, layered on .venv: nbgrader turns on Jupyter extensions wherever it is
installed, and the learners' JupyterLab stays without them); elsewhere this file skips.
One known-wrong answer per lab by default; KVLAB_NBGRADER_ALL=1 hands in every one, the
solved source and the student version.
Each submission is one kernel start (torch import included): ~5-10 s on 2 cores.
"""

from __future__ import annotations

import contextlib
import html
import io
import os
import re
import shutil
import warnings
from pathlib import Path

import nbformat
import pytest
from lab_mistakes import LAB_NAMES, MISTAKES, Mistake, of, submission

from kvlab.labs import student

pytest.importorskip(
    "nbgrader",
    reason="nbgrader is not installed: it is the optional `grading` extra (make test-grading)",
)

REPO = Path(__file__).resolve().parents[1]
LABS = student.LABS
NAMES = student.lab_names()
ALEMBIC_HEAD = "e43177bfe90b"  # the gradebook schema of nbgrader 0.9.6 (`alembic heads`)
HIDDEN_SEED = 2026  # the seed of the sources' hidden tests
EVERY_MISTAKE = os.environ.get("KVLAB_NBGRADER_ALL") == "1"


def _meta(cell) -> dict:
    return cell.metadata.get("nbgrader", {})


def _source(name: str) -> nbformat.NotebookNode:
    return nbformat.read(LABS / "source" / name / f"{name}.ipynb", as_version=4)


def _solved_cell(name: str) -> str:
    """The source's exercise cell as a learner who solved it hands it in (no markers)."""
    (cell,) = [c for c in _source(name).cells if _meta(c).get("solution")]
    return "\n".join(line for line in cell.source.split("\n") if "### " not in line)


def _mistakes(name: str) -> list[Mistake]:
    return of(name) if EVERY_MISTAKE else of(name)[:1]


def _submissions(name: str) -> dict[str, str | None]:
    """{student: their exercise cell}; None hands in the student version untouched."""
    subs: dict[str, str | None] = {}
    if EVERY_MISTAKE:
        subs.update({"solved": _solved_cell(name), "unsolved": None})
    subs.update({m.name: submission(m) for m in _mistakes(name)})
    return subs


def _checks(name: str) -> dict[str, tuple[str, float]]:
    """{grade_id: (check name, points)} of the lab's autograded cells."""
    out = {}
    for cell in _source(name).cells:
        if _meta(cell).get("grade"):
            check = re.search(r'result\.raise_for_check\("(.*)"\)', cell.source).group(1)
            out[_meta(cell)["grade_id"]] = (check, _meta(cell)["points"])
    return out


def _failures(name: str, exercise: str) -> tuple[list, list]:
    """What kvlab's grader reports failed for an exercise cell, worked out in this process: on
    the cases the notebook shows (seed 0), then on the hidden tests' seed."""
    namespace: dict = {}
    cells = {_meta(c).get("grade_id"): c.source for c in _source(name).cells}
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(cells["setup"], "<setup>", "exec"), namespace)
        exec(compile(exercise, "<exercise>", "exec"), namespace)
        grader = cells["grader"].removeprefix("result = ")
        calls = [f"{grader.rstrip()[:-1]}, verbose=False, seed={s})" for s in (0, HIDDEN_SEED)]
        shown, hidden = (eval(call, namespace).failures for call in calls)
    return shown, hidden


def _expected_cells(name: str, failed: set[str]) -> dict[str, float]:
    """Each cell's score: its points when its check failed on neither seed."""
    checks = _checks(name)
    return {g: 0.0 if check in failed else float(pts) for g, (check, pts) in checks.items()}


def _text(page: Path) -> str:
    """A feedback page's text (the highlighter splits code into <span>s)."""
    return html.unescape(re.sub(r"<[^>]+>", "", page.read_text()))


@pytest.fixture(scope="module")
def course(tmp_path_factory, monkeypatch_module):
    """A course directory with every lab generated, handed in, autograded and fed back."""
    import nbgrader.api
    from nbgrader.apps import NbGraderAPI
    from nbgrader.coursedir import CourseDirectory
    from traitlets.config.loader import PyFileConfigLoader

    root = tmp_path_factory.mktemp("course")
    shutil.copy(LABS / "nbgrader_config.py", root)
    for name in NAMES:  # the whole folder, jupytext pair (with the solutions) included
        shutil.copytree(LABS / "source" / name, root / "source" / name)
    # The kernels import this checkout's kvlab; a new gradebook asks `alembic heads` (a
    # subprocess that must be on PATH and imports all of nbgrader) for a fixed revision.
    path = os.environ.get("PYTHONPATH", "")
    monkeypatch_module.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(REPO), path) if p))
    monkeypatch_module.setattr(nbgrader.api, "get_alembic_version", lambda: ALEMBIC_HEAD)

    config = PyFileConfigLoader("nbgrader_config.py", path=str(root)).load_config()
    api = NbGraderAPI(coursedir=CourseDirectory(root=str(root), config=config), config=config)

    def ok(result: dict) -> None:
        assert result["success"], f"{result.get('log')}\n{result.get('error')}"

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="nbgrader.api")  # SQLAlchemy 2.1 SAWarnings
        for name in NAMES:
            ok(api.generate_assignment(name, force=True))
            release = root / "release" / name / f"{name}.ipynb"
            for who, exercise in _submissions(name).items():
                nb = nbformat.read(release, as_version=4)
                if exercise is not None:
                    (cell,) = [c for c in nb.cells if _meta(c).get("solution")]
                    cell.source = exercise
                out = root / "submitted" / who / name / f"{name}.ipynb"
                out.parent.mkdir(parents=True)
                nbformat.write(nb, out)
            ok(api.autograde(name, "*", force=True))
            ok(api.generate_feedback(name, "*", force=True))
    return root


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def _scores(root: Path, name: str) -> dict[str, tuple[float, float, dict[str, float]]]:
    from nbgrader.api import Gradebook

    out = {}
    with Gradebook(f"sqlite:///{root / 'gradebook.db'}", "kvlab") as gb:
        for sub in gb.assignment_submissions(name):
            cells = {g.name: g.score for nb in sub.notebooks for g in nb.grades}
            out[sub.student.id] = (sub.score, sub.max_score, cells)
    return out


@pytest.mark.parametrize("name", NAMES)
def test_generate_assignment_makes_the_committed_student_notebook(course, name):
    assert [p.name for p in (course / "release" / name).iterdir()] == [f"{name}.ipynb"]
    release = nbformat.read(course / "release" / name / f"{name}.ipynb", as_version=4)
    committed = nbformat.read(LABS / f"{name}.ipynb", as_version=4)
    assert [c.source for c in release.cells] == [c.source for c in committed.cells]
    for got, want in zip(release.cells, committed.cells):
        added = ("checksum", "cell_type")  # what only the gradebook needs
        assert {k: v for k, v in _meta(got).items() if k not in added} == _meta(want)
        for key in ("editable", "deletable"):
            assert got.metadata.get(key, True) == want.metadata.get(key, True), got.source


@pytest.mark.parametrize("name", NAMES)
def test_autograde_gives_each_submission_the_points_of_the_checks_it_passes(course, name):
    scores = _scores(course, name)
    subs = _submissions(name)
    assert sorted(scores) == sorted(subs)
    total = sum(points for _, points in _checks(name).values())
    for who, (score, max_score, cells) in scores.items():
        assert max_score == total
        assert score == sum(cells.values()), who
    # The solved source passes every check on both seeds (tests/test_labs.py runs it), so
    # its hand-in gets every point; the untouched student version gets none.
    if EVERY_MISTAKE:
        assert scores["solved"][2] == _expected_cells(name, set())
        assert scores["unsolved"][0] == 0
    for mistake in _mistakes(name):
        shown, hidden = _failures(name, subs[mistake.name])
        failed = {f.check for f in shown + hidden}
        assert scores[mistake.name][2] == _expected_cells(name, failed), mistake.name
        # the check that names the mistake's invariant scores 0
        assert shown and shown[0].invariant == mistake.invariant, mistake.name


@pytest.mark.parametrize("name", NAMES)
def test_feedback_shows_kvlabs_report_and_never_the_hidden_tests(course, name):
    for who in _submissions(name):
        text = _text(course / "feedback" / who / name / f"{name}.html")
        for secret in ("HIDDEN TESTS", "hidden = check_", f"seed={HIDDEN_SEED}", "SOLUTION"):
            assert secret not in text, (who, secret)
        if who == "unsolved":
            assert "not implemented yet" in text
    for mistake in _mistakes(name):
        text = _text(course / "feedback" / mistake.name / name / f"{name}.html")
        assert f"Broken invariant: {mistake.invariant}" in text, mistake.name


def test_every_lab_is_in_the_workflow():
    assert NAMES == list(LAB_NAMES)
    assert {m.lab for m in MISTAKES} == set(NAMES)
