"""`show_source`: the lines of kvlab that implement a mechanism, shown in the notebook.

The lines come from the installed library's own source at run time, so what the learner
reads is what runs; nbval compares the stored copy with a fresh one, so a change to the
library that the notebook's prose no longer describes shows up as a failing notebook.
"""

from __future__ import annotations

import inspect
from pathlib import Path

from IPython.display import Markdown

_ROOT = Path(__file__).resolve().parents[2]  # the repository (or site-packages) root


def _where(path: str) -> str:
    """A source path relative to the project (kvlab/..., kernels/...), else as given."""
    try:
        return Path(path).resolve().relative_to(_ROOT).as_posix()
    except ValueError:
        return Path(path).name


def source_lines(obj, start: str | None = None, end: str | None = None) -> tuple[str, int, int]:
    """(path, first line, last line) of `obj`'s source, or of its part from the first line
    containing `start` to the first line after it containing `end` (both included).

    Raises ValueError naming the marker when `start` or `end` is not in the source, so a
    notebook whose library changed under it fails loudly instead of showing other lines.
    """
    obj = inspect.unwrap(obj)  # a decorated function's own lines and file, not its wrapper's
    lines, first = inspect.getsourcelines(obj)
    a, b = 0, len(lines) - 1
    if start is not None:
        a = next((i for i, line in enumerate(lines) if start in line), None)
        if a is None:
            raise ValueError(f"{start!r} is not in the source of {obj.__qualname__}")
    if end is not None:
        b = next((i for i in range(a, len(lines)) if end in lines[i]), None)
        if b is None:
            raise ValueError(f"{end!r} is not in the source of {obj.__qualname__} after {start!r}")
    return inspect.getsourcefile(obj), first + a, first + b


def show_source(obj, start: str | None = None, end: str | None = None) -> Markdown:
    """The source of a kvlab function, method or class (or its lines from `start` to `end`,
    text each line contains) as a Markdown code block headed by its file and line numbers."""
    path, a, b = source_lines(obj, start, end)
    lines = Path(path).read_text(encoding="utf-8").splitlines()[a - 1 : b]
    indent = min((len(s) - len(s.lstrip()) for s in lines if s.strip()), default=0)
    code = "\n".join(s[indent:] for s in lines)
    return Markdown(f"`{_where(path)}`, lines {a}-{b}:\n\n```python\n{code}\n```")
