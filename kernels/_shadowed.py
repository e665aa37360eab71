"""When this folder is imported as a bare `kernels`, hand the name to the installed package.

kvlab's kernels install as `kvlab.kernels`. A Python started in the repository root
(`python -c ...`, `python -m ...`) has that root on sys.path, where this folder would answer
`import kernels` instead of Hugging Face's `kernels` distribution, which transformers (5.25
and later) imports on its own. This loads that distribution under the name.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the folder this one shadows from


def load_installed() -> None:
    """Put the installed `kernels` in sys.modules; ImportError where none is installed."""
    path = [entry for entry in sys.path if Path(entry or ".").resolve() != ROOT]
    spec = importlib.machinery.PathFinder.find_spec("kernels", path)
    if spec is None or spec.loader is None:
        raise ImportError(
            "no `kernels` package is installed; kvlab's kernels import as `kvlab.kernels`",
            name="kernels",
        )
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module  # what the import that ran this one returns
    spec.loader.exec_module(module)
