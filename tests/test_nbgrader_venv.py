"""The nbgrader workflow in `make test`: tests/test_labs_nbgrader.py, run by the grading venv.

nbgrader lives in `.venv-grading` (`make grading`, which `make test` runs), layered on
.venv, so that the learners' JupyterLab in .venv stays without nbgrader's extensions. Where
nbgrader is importable here, test_labs_nbgrader.py runs in this process and this test
skips; where neither is there, it skips saying how to get it. $KVLAB_GRADING_VENV names
another venv.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("KVLAB_GRADING_VENV", REPO / ".venv-grading"))


def test_the_nbgrader_workflow_passes_in_the_grading_venv():
    if importlib.util.find_spec("nbgrader") is not None:
        pytest.skip("nbgrader is installed here: tests/test_labs_nbgrader.py runs directly")
    python = VENV / "bin" / "python"
    if not python.exists():
        pytest.skip(f"no grading venv at {VENV}: `make grading` builds it (`make test` does)")
    env = dict(os.environ, JUPYTER_PATH=str(REPO / ".venv" / "share" / "jupyter"))
    for name in [n for n in env if n.startswith("PYTEST_")]:  # not an xdist worker there
        env.pop(name)
    result = subprocess.run(
        [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist"]
        + [str(REPO / "tests" / "test_labs_nbgrader.py")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    report = result.stdout[-6000:] + result.stderr[-2000:]
    assert result.returncode == 0, f"the nbgrader workflow failed:\n{report}"
    summary = result.stdout.strip().splitlines()[-1]  # "N passed in S s"
    assert " passed" in summary and "skipped" not in summary, report
