"""The notebooks' stored `show_source` outputs against the library's source now.

    python tests/show_source_outputs.py            # list the stale ones
    python tests/show_source_outputs.py --update   # rewrite them from the source

A stored output is stale when the lines it names in its file are not the code it shows (a
library change moved or edited them). `--update` evaluates the cell's `show_source(...)`
calls, with the notebook's imports, and stores what they print now: the output a re-run
of the cell would store, without re-running the notebook's measurements. Read the prose
around an updated cell: it may describe the old code.
"""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
SHOWN = re.compile(
    r"^`((?:kvlab|kernels)/[^`]+)`, lines (\d+)-(\d+):\n\n```python\n(.*)\n```$", re.S
)


def notebooks() -> list[Path]:
    return sorted([*NOTEBOOKS.glob("*.ipynb"), *NOTEBOOKS.glob("labs/source/*/*.ipynb")])


def _code_now(where: str, a: int, b: int) -> str | None:
    """Lines a..b of `where`, dedented as show_source dedents them (None: no such file)."""
    if not (ROOT / where).is_file():
        return None
    lines = (ROOT / where).read_text(encoding="utf-8").splitlines()[a - 1 : b]
    indent = min((len(s) - len(s.lstrip()) for s in lines if s.strip()), default=0)
    return "\n".join(s[indent:] for s in lines)


def shown(nb: dict) -> list[tuple[dict, dict, re.Match]]:
    """(cell, output, match) for every stored show_source output of a notebook."""
    out = []
    for cell in nb["cells"]:
        for output in cell.get("outputs", []):
            text = "".join(output.get("data", {}).get("text/markdown", ""))
            if m := SHOWN.match(text):
                out.append((cell, output, m))
    return out


def is_stale(m: re.Match) -> bool:
    """Whether the lines a shown output names are no longer the code it shows."""
    return _code_now(m[1], int(m[2]), int(m[3])) != m[4]


def stale(nb: dict) -> list[tuple[dict, dict, re.Match]]:
    return [(c, o, m) for c, o, m in shown(nb) if is_stale(m)]


def _imports(nb: dict) -> dict:
    """A namespace holding every name the notebook imports (its import statements alone)."""
    namespace: dict = {}
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        try:
            tree = ast.parse("".join(cell["source"]))
        except SyntaxError:  # a cell with IPython magics
            continue
        imports = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
        exec(compile(ast.Module(imports, []), "<imports>", "exec"), namespace)
    return namespace


def update(path: Path) -> int:
    """Rewrite the stale show_source outputs of one notebook; returns how many."""
    nb = json.loads(path.read_text())
    todo = stale(nb)
    if not todo:
        return 0
    namespace = _imports(nb)
    for cell in {id(c): c for c, _, _ in todo}.values():
        calls = [
            node
            for node in ast.walk(ast.parse("".join(cell["source"])))
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "show_source"
        ]
        calls.sort(key=lambda node: (node.lineno, node.col_offset))
        fresh = [eval(compile(ast.Expression(c), "<cell>", "eval"), namespace).data for c in calls]
        outputs = [o for c, o, _ in shown({"cells": [cell]})]
        assert len(fresh) == len(outputs), f"{path.name}: cannot pair the cell's calls"
        for output, text in zip(outputs, fresh):
            output["data"]["text/markdown"] = text.splitlines(keepends=True)  # as Jupyter saves
    path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    return len(todo)


if __name__ == "__main__":
    for path in notebooks():
        if "--update" in sys.argv:
            if n := update(path):
                print(f"{path.relative_to(ROOT)}: {n} show_source outputs updated")
        else:
            for _, _, m in stale(json.loads(path.read_text())):
                print(f"{path.relative_to(ROOT)}: {m[1]} lines {m[2]}-{m[3]} changed")
