"""Notebook wall times: each notebook run top to bottom in a temp copy, against a 180 s budget.

    python benchmarks/notebook_times.py                  # notebooks/NN_*.ipynb + the lab sources
    python benchmarks/notebook_times.py notebooks/01_why_a_kv_cache.ipynb --out times.json
    python benchmarks/notebook_times.py --quick          # a tiny notebook of its own, seconds
    python benchmarks/notebook_times.py notebooks/04_quantized_kv.ipynb --out T.json --update

Each notebook is copied to a temporary directory and executed there by a fresh kernel
(the committed file is never written), with the notebook's own folder as the working
directory, so relative paths such as notebook 07's ../benchmarks/results still resolve.
A progress line per notebook goes to stderr as it finishes, then a table; the JSON on
stdout (and in --out) holds per notebook: wall seconds (kernel start to last cell),
code cells, ok or error (the first failing cell and its error), the slowest cell, and
whether it ran ok within --budget seconds, the date it ran and the load average then;
plus the machine: architecture, CPU cores and the torch threads a kernel gets (set them
with --threads or OMP_NUM_THREADS). --update re-times some notebooks: their new rows
replace their old ones in --out, and every other row stays as it was measured (and the
provenance block `make notebook-times` stamps on the table).
--store writes each notebook that ran ok back over its file: its stored outputs become
this timed run's (re-executing the course on a quiet machine and timing it is one pass).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError

from kvlab.experiments.scripts import report, script_parser

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 180.0


def default_notebooks() -> list[Path]:
    """notebooks/NN_*.ipynb, then the labs' solved sources notebooks/labs/source/*/*.ipynb."""
    notebooks = ROOT / "notebooks"
    return sorted(notebooks.glob("[0-9][0-9]_*.ipynb")) + sorted(
        notebooks.glob("labs/source/*/*.ipynb")
    )


def tiny_notebook(folder: Path) -> Path:
    """A three-cell notebook (--quick): one markdown cell, two short code cells."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_markdown_cell("# A tiny notebook for `notebook_times.py --quick`"),
        nbformat.v4.new_code_cell("squares = [i * i for i in range(1000)]"),
        nbformat.v4.new_code_cell("print(sum(squares))"),
    ]
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    path = folder / "00_tiny.ipynb"
    nbformat.write(nb, path)
    return path


def kernel_env(threads: int | None) -> dict[str, str]:
    """The kernel's environment: this one, kvlab's root on PYTHONPATH, --threads applied."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    if threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    return env


def torch_threads(env: dict[str, str]) -> int:
    """torch.get_num_threads() in a fresh interpreter with the kernels' environment."""
    code = "import torch; print(torch.get_num_threads())"
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return int(done.stdout.strip())


def machine(threads: int) -> str:
    """Like kvlab.experiments.scripts.machine: "x86_64, 2 cores, 1 torch threads"."""
    return f"{platform.machine()}, {os.cpu_count()} cores, {threads} torch threads"


def _seconds(cell) -> float | None:
    """A code cell's run time from the timestamps nbclient records in its metadata."""
    timing = cell.metadata.get("execution", {})
    start, end = timing.get("iopub.execute_input"), timing.get("shell.execute_reply")
    if not (start and end):
        return None
    parse = datetime.fromisoformat
    return (parse(end.replace("Z", "+00:00")) - parse(start.replace("Z", "+00:00"))).total_seconds()


def failed_cell(cells: list) -> int | None:
    """The code cell that raised (it has an error output), else the first that never
    finished (a timeout), as an index among the code cells."""
    tests = (
        lambda c: any(o.get("output_type") == "error" for o in c.get("outputs", [])),
        lambda c: c.get("execution_count") is None,
    )
    return next((i for test in tests for i, c in enumerate(cells) if test(c)), None)


def time_notebook(
    path: Path,
    env: dict[str, str],
    budget_s: float = BUDGET_S,
    cell_timeout_s: int = 3000,
    store: bool = False,
) -> dict:
    """Execute a temp copy of `path` top to bottom in a fresh kernel; one row of the table.

    store: write the executed copy back over `path` when every cell ran (never on error)."""
    path = Path(path).resolve()
    with tempfile.TemporaryDirectory(prefix="kvlab-nbtime-") as tmp:
        copy = Path(tmp) / path.name
        copy.write_bytes(path.read_bytes())
        nb = nbformat.read(copy, as_version=4)
        client = NotebookClient(
            nb,
            timeout=cell_timeout_s,
            resources={"metadata": {"path": str(path.parent)}},  # the working directory
        )
        code_cells = [c for c in nb.cells if c.cell_type == "code"]
        status, error, load_at_start = "ok", None, os.getloadavg()[0]
        start = time.perf_counter()
        try:
            client.execute(env=env)
        except (CellExecutionError, CellTimeoutError) as exc:
            status = "error"
            lines = str(exc).strip().splitlines()
            error = {
                "code_cell": failed_cell(code_cells),
                "message": lines[-1][:300] if lines else type(exc).__name__,
            }
        wall_s = time.perf_counter() - start
    if store and status == "ok":
        nb.metadata.pop("widgets", None)  # the live widgets' state: megabytes, not output
        nbformat.write(nb, path)
    times = [(i, _seconds(c)) for i, c in enumerate(code_cells)]
    times = [(i, s) for i, s in times if s is not None]
    slowest = max(times, key=lambda t: t[1], default=None)
    if slowest is not None:
        slowest = {"code_cell": slowest[0], "s": round(slowest[1], 1)}
    try:
        name = str(path.relative_to(ROOT))
    except ValueError:
        name = path.name
    return {
        "notebook": name,
        "measured": datetime.now().strftime("%Y-%m-%d %H:%M"),
        "load_average_at_start": round(load_at_start, 2),
        "wall_s": round(wall_s, 1),
        "cells": len(code_cells),
        "status": status,
        "within_budget": status == "ok" and wall_s <= budget_s,
        "slowest_cell": slowest,
        "error": error,
    }


def merged(old: list[dict], new: list[dict]) -> list[dict]:
    """`old`'s rows with those of the notebooks in `new` replaced (new ones appended)."""
    fresh = {row["notebook"]: row for row in new}
    kept = [fresh.pop(row["notebook"], row) for row in old]
    return kept + list(fresh.values())


def table(rows: list[dict], budget_s: float) -> str:
    """The rows as a fixed-width text table."""
    width = max([len("notebook"), *(len(r["notebook"]) for r in rows)])
    lines = [
        f"{'notebook':{width}}  {'wall s':>7}  {'cells':>5}  {'status':6}  {f'<= {budget_s:g} s'}"
    ]
    for r in rows:
        within = "yes" if r["within_budget"] else "NO"
        name, wall, cells = r["notebook"], r["wall_s"], r["cells"]
        lines.append(f"{name:{width}}  {wall:7.1f}  {cells:5d}  {r['status']:6}  {within}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = script_parser(__doc__)
    parser.add_argument("notebooks", nargs="*", type=Path, help="default: every notebook")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds (default 180)")
    parser.add_argument("--cell-timeout", type=int, default=3000, help="seconds per cell")
    parser.add_argument("--update", action="store_true",
                        help="keep the other notebooks' rows already in --out")  # fmt: skip
    parser.add_argument("--store", action="store_true",
                        help="store the outputs of each run that went through")  # fmt: skip
    args = parser.parse_args(argv)
    if args.model:
        parser.error("--model does not apply: each notebook loads its own model")
    if args.update and not (args.out and args.out.exists()):
        parser.error("--update needs --out naming an existing table")
    env = kernel_env(args.threads)
    with tempfile.TemporaryDirectory(prefix="kvlab-nbtime-quick-") as tmp:
        if args.quick:
            paths = [tiny_notebook(Path(tmp))]
        else:
            paths = args.notebooks or default_notebooks()
        result = {
            "machine": machine(torch_threads(env)),
            "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
            "budget_s": args.budget,
        }
        rows = []
        for i, path in enumerate(paths, start=1):
            row = time_notebook(path, env, args.budget, args.cell_timeout, args.store)
            rows.append(row)
            note = f" ({row['error']['message']})" if row["error"] else ""
            print(
                f"[{i}/{len(paths)}] {row['notebook']}: {row['wall_s']:.1f} s, "
                f"{row['cells']} cells, {row['status']}{note}",
                file=sys.stderr,
                flush=True,
            )
    if args.update:  # the other rows, and the provenance block stamp.py gave the table
        old = json.loads(args.out.read_text())
        rows = merged(old["notebooks"], rows)
        if "provenance" in old:
            result = {"provenance": old["provenance"], **result}
    result["notebooks"] = rows
    result["all_within_budget"] = all(r["within_budget"] for r in rows)
    print(table(rows, args.budget), file=sys.stderr, flush=True)
    return report(result, args.out)


if __name__ == "__main__":
    main()
