"""Figures the docs quote from a saved run, each tied to the file that holds it.

A figure in README.md or docs/**/*.md that comes from a run carries a marker right after
it, an HTML comment (invisible on GitHub and on the site) naming the file and the value:

    kvlab 0.74x<!-- q: bench_uniform_chat_vllm.avx2.json median_ratios["kvlab/vllm"] -->
    469 µs<!-- q: notebooks/10_kv_tiers.ipynb cells[source~copy_times].text/to_host +(\\d+)/ -->
    204 ms<!-- q: notebooks/10_kv_tiers.ipynb cells[source~ttft].figures[0].data[0].y[0] -->
    -45.0%<!-- q: some_run.avx2.json configs.host.reduction *-100 -->

- The figure is the last number before the marker on its line (after any earlier
  marker): "0.74x", "**1.33x**", "1,076 ms", "-45.0%" read as 0.74, 1.33, 1076, -45.0.
- The file: a bare name is in benchmarks/results/; a path is from the repository root. A
  .json file is its JSON; a notebook (.ipynb) is its stored outputs, as
  {"cells": [{"source", "text", "figures"}, ...]} over its code cells: `text` the printed
  output (streams and text/plain), `figures` the plotly figures it stored.
- The value: a path into that document, `name` or `.name` for a key made of word
  characters and dashes, `["any key"]` for any other key (`.["any key"]` right after a
  `]`), `[3]` (or `.3`, needed right after a `]`: the site's link checker takes `][`
  for a link) for a list's item,
  `[field=value, other="quoted value"]` for the one record of a list whose fields have
  those values (as text), `[field~text]` for the one whose field contains the text; a
  last `/regex/` takes its first group (or the whole match) from the string it reached.
- `*SCALE` (optional, last): the value is multiplied by it first (`*1e3`: seconds quoted
  as ms; `*100`: a fraction quoted as a percent).

A quoted figure agrees with its value when it is the value rounded to the digits it shows
(0.74 for 0.745 or 0.7449; 1,076 for 1075.6). tests/test_quoted_figures.py checks every
marker of every page, so a figure and its file cannot drift apart: re-running a benchmark
makes the test name every figure it changed.

    python tests/quoted_figures.py            # every quoted figure, its file's value, OK or not
    python tests/quoted_figures.py --update   # rewrite each figure from its file (same digits)

`--update` rewrites the numbers only: read the sentences around the figures it changed.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PLOTLY = "application/vnd.plotly.v1+json"

MARKER = re.compile(r"<!--\s*q:\s*(?P<source>\S+)\s+(?P<path>.+?)(?:\s+\*(?P<scale>\S+))?\s*-->")
# a sign counts unless it joins two figures ("3.1-7.3": a range) or follows a marker
NUMBER = re.compile(r"(?:(?<![\w.)>])[-−])?\d[\d,]*(?:\.\d+)?")
# one step of a value's path: .name, ["key"], [3], [filters], /regex/
STEP = re.compile(
    r"""\.(?P<dot>\d+)
      | \.?(?P<name>[A-Za-z_][\w-]*)
      | \.?\[\s*"(?P<key>(?:[^"\\]|\\.)*)"\s*\]
      | \[\s*(?P<index>-?\d+)\s*\]
      | \[(?P<filters>[^\]]*[=~][^\]]*)\]
      | /(?P<regex>(?:[^/\\]|\\.)+)/""",
    re.VERBOSE,
)
FILTER = re.compile(r"""\s*([\w-]+)\s*([=~])\s*("(?:[^"\\]|\\.)*"|[^,]*?)\s*(?:,|$)""")


class QuoteError(ValueError):
    """A marker whose file or value cannot be found."""


@dataclass(frozen=True)
class Quote:
    """One quoted figure: where it is, what it shows, what its file holds."""

    page: Path
    line: int  # 1-based
    text: str  # the figure as quoted, e.g. "1,076"
    start: int  # its offset in the page's text
    source: str
    path: str
    scale: float

    @property
    def where(self) -> str:
        return f"{_name(self.page)}:{self.line}"

    @property
    def quoted(self) -> float:
        return float(self.text.replace(",", "").replace("−", "-"))

    @property
    def digits(self) -> int:
        """Decimals the figure shows."""
        return len(self.text.partition(".")[2])

    def value(self) -> float:
        """The file's value, scaled."""
        return resolve(self.source, self.path) * self.scale

    def agrees(self) -> bool:
        return abs(self.value() - self.quoted) <= 0.5 * 10**-self.digits + 1e-9

    def rewritten(self) -> str:
        """The file's value in the figure's format (its decimals, its thousands commas)."""
        text = f"{self.value():,.{self.digits}f}" if "," in self.text else None
        text = text or f"{self.value():.{self.digits}f}"
        return text if not self.text.startswith("−") else text.replace("-", "−")


def _name(page: Path) -> Path:
    return page.relative_to(ROOT) if page.is_relative_to(ROOT) else page


def pages() -> list[Path]:
    """README.md and every page under docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def quotes(page: Path, text: str | None = None) -> list[Quote]:
    """Every marked figure of a page (QuoteError for a marker with no number before it)."""
    text = page.read_text(encoding="utf-8") if text is None else text
    found = []
    for match in MARKER.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        if "|" in match.group():
            raise QuoteError(f"{_name(page)}:{line}: a '|' in a marker splits a table's cell")
        if "][" in match.group():  # mkdocs-autorefs takes [a][b] for a link, even here
            raise QuoteError(
                f'{_name(page)}:{line}: \'][\' in a marker: write .N for [N], .["key"] for ["key"]'
            )
        line_start = text.rfind("\n", 0, match.start()) + 1
        previous = [m.end() for m in MARKER.finditer(text, line_start, match.start())]
        begin = max([line_start, *previous])
        numbers = list(NUMBER.finditer(text, begin, match.start()))
        if not numbers:
            raise QuoteError(f"{_name(page)}:{line}: a marker with no number before it")
        number = numbers[-1]
        found.append(
            Quote(
                page,
                line,
                number.group(),
                number.start(),
                match["source"],
                match["path"].strip(),
                float(match["scale"]) if match["scale"] else 1.0,
            )
        )
    return found


@cache
def document(source: str):
    """The JSON a marker's file holds (a notebook: its code cells' stored outputs)."""
    path = RESULTS / source if "/" not in source else ROOT / source
    if not path.exists():
        raise QuoteError(f"{source}: no such file ({_name(path)})")
    data = json.loads(path.read_text(encoding="utf-8"))
    if path.suffix != ".ipynb":
        return data
    cells = []
    for cell in data["cells"]:
        if cell["cell_type"] != "code":
            continue
        text, figures = [], []
        for output in cell.get("outputs", []):
            if "text" in output:
                text.append("".join(output["text"]))
            shown = output.get("data", {})
            if PLOTLY in shown:
                figures.append(shown[PLOTLY])
            elif "text/plain" in shown:
                text.append("".join(shown["text/plain"]))
        cells.append({"source": "".join(cell["source"]), "text": "".join(text), "figures": figures})
    return {"cells": cells}


def resolve(source: str, path: str) -> float:
    """The number at `path` in `source`'s document (see the module doc)."""
    value, at, done = document(source), 0, []
    while at < len(path):
        step = STEP.match(path, at)
        if not step or step.end() == at:
            raise QuoteError(f"{source} {path}: cannot read the path from {path[at:]!r}")
        at = step.end()
        value = _step(value, step, f"{source} {''.join(done)}")
        done.append(step.group())
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise QuoteError(f"{source} {path}: {value!r} is not a number")
    try:
        return float(str(value).replace(",", ""))
    except ValueError:
        raise QuoteError(f"{source} {path}: {value!r} is not a number") from None


def _step(value, step: re.Match, where: str):
    try:
        if step["name"] is not None or step["key"] is not None:
            key = step["name"] if step["name"] is not None else json.loads(f'"{step["key"]}"')
            return value[key]
        if step["index"] is not None or step["dot"] is not None:
            return value[int(step["index"] if step["index"] is not None else step["dot"])]
        if step["filters"] is not None:
            return _one(value, step["filters"], where)
        found = re.search(step["regex"], value)
        if not found:
            raise QuoteError(f"{where}: /{step['regex']}/ finds nothing")
        return found.group(1) if found.groups() else found.group()
    except (KeyError, IndexError, TypeError) as error:
        raise QuoteError(f"{where}: no {step.group()!r} there ({error!r})") from None


def _one(records: list, filters: str, where: str):
    tests = []
    for name, how, wanted in FILTER.findall(filters):
        if wanted.startswith('"'):
            wanted = json.loads(wanted)
        tests.append((name, how, wanted))
    chosen = [
        r
        for r in records
        if all(
            (wanted in str(r.get(name))) if how == "~" else str(r.get(name)) == wanted
            for name, how, wanted in tests
        )
    ]
    if len(chosen) != 1:
        raise QuoteError(f"{where}: [{filters}] matches {len(chosen)} records, not one")
    return chosen[0]


def check(paths: list[Path] | None = None) -> tuple[list[Quote], list[str]]:
    """(every quote, a line per quote that disagrees with its file or cannot be read)."""
    every, problems = [], []
    for page in paths or pages():
        try:
            found = quotes(page)
        except QuoteError as error:
            problems.append(str(error))
            continue
        for quote in found:
            every.append(quote)
            try:
                if not quote.agrees():
                    problems.append(
                        f"{quote.where}: quotes {quote.text}, {quote.source} holds "
                        f"{quote.rewritten()} ({quote.value()!r}) at {quote.path}"
                    )
            except QuoteError as error:
                problems.append(f"{quote.where}: {error}")
    return every, problems


def update(paths: list[Path] | None = None) -> list[str]:
    """Rewrite every readable quoted figure from its file; the lines it changed."""
    changed = []
    for page in paths or pages():
        text = page.read_text(encoding="utf-8")
        edits = []
        for quote in quotes(page, text):
            try:
                new = quote.rewritten()
            except QuoteError:
                continue
            if new != quote.text:
                edits.append((quote.start, quote.start + len(quote.text), new))
                changed.append(f"{quote.where}: {quote.text} -> {new}")
        for start, end, new in sorted(edits, reverse=True):
            text = text[:start] + new + text[end:]
        if edits:
            page.write_text(text, encoding="utf-8")
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--update", action="store_true", help="rewrite figures from files")
    args = parser.parse_args(argv)
    if args.update:
        for line in update():
            print(line)
        return 0
    every, problems = check()
    for quote in every:
        try:
            state = "ok" if quote.agrees() else "DIFFERS"
            print(f"{state:8} {quote.where}: {quote.text} <- {quote.source} {quote.path}")
        except QuoteError:
            pass
    for problem in problems:
        print("PROBLEM ", problem)
    print(f"{len(every)} quoted figures, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
