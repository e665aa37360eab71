"""Pages made at build time (mkdocs-gen-files runs this in `mkdocs build`).

- notebooks/: every notebook (notebooks/NN_*.ipynb, the labs' learner versions) with its
  stored outputs, ready for mkdocs-jupyter: a plotly figure (stored as
  application/vnd.plotly.v1+json, which nbconvert does not draw) becomes HTML drawn by
  the plotly.js of the installed plotly package, served from this site; a widget app,
  which needs a live kernel, becomes a note (and the browser test's screenshot of it,
  where there is one). notebooks/SUMMARY.md lists them for the navigation.
- results.md: every file in benchmarks/results/, its provenance (benchmark, machine,
  CPU flags, date, command, rounds) and its figures as tables; the raw files beside it.

Nothing here imports kvlab: the build needs only the docs extra.
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import mkdocs_gen_files
import nbformat
import plotly
import plotly.io as pio

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
RESULTS = ROOT / "benchmarks" / "results"
SCREENSHOTS = ROOT / "docs" / "screenshots"
PLOTLY_MIME = "application/vnd.plotly.v1+json"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
PLOTLY_JS = "assets/javascripts/plotly.min.js"  # docs/overrides/main.html loads it
PROVENANCE = ("benchmark", "machine_class", "machine", "cpu_flags", "date", "command", "rounds")


# --- notebooks ---------------------------------------------------------------------------
def plotly_html(figure: dict, div_id: str) -> str:
    """A stored plotly figure as a div and the script that draws it (plotly.js loaded once
    per page, in the page's head)."""
    return pio.to_html(
        figure,
        include_plotlyjs=False,
        full_html=False,
        div_id=div_id,
        validate=False,
        config={"responsive": True},
    )


def widget_note(screenshot: str | None) -> str:
    note = (
        '<div class="admonition note"><p class="admonition-title">Interactive</p>'
        "<p>A widget app draws here when the notebook runs: open it in JupyterLab "
        "(<code>make lab</code>) to move its controls.</p>"
    )
    if screenshot:
        note += (
            f'<p><img alt="the widget app in JupyterLab" src="../../screenshots/{screenshot}">'
            "</p><p><em>Screenshot taken by the browser test (tests/test_browser.py).</em></p>"
        )
    return note + "</div>"


def site_notebook(path: Path) -> nbformat.NotebookNode:
    """The notebook as the site shows it: figures as HTML, widget apps as a note."""
    nb = nbformat.read(path, as_version=4)
    nb.metadata.pop("widgets", None)
    shots = sorted(p.name for p in SCREENSHOTS.glob(f"{path.stem}*.png"))
    figure = 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        for output in cell.get("outputs", []):
            data = output.get("data")
            if not data:
                continue
            if PLOTLY_MIME in data:
                figure += 1
                html_figure = plotly_html(data.pop(PLOTLY_MIME), f"{path.stem}-figure-{figure}")
                data.clear()
                data["text/html"] = html_figure
            elif WIDGET_MIME in data:
                data.clear()
                data["text/html"] = widget_note(shots.pop(0) if shots else None)
    return nb


def notebook_title(nb: nbformat.NotebookNode, fallback: str) -> str:
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            match = re.search(r"^#\s+(.+)$", cell.source, flags=re.MULTILINE)
            if match:
                return match.group(1).strip()
    return fallback


def write_notebooks() -> None:
    nav = []
    for path in sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")):
        nb = site_notebook(path)
        with mkdocs_gen_files.open(f"notebooks/{path.name}", "w") as f:
            nbformat.write(nb, f)
        nav.append(f"* [{notebook_title(nb, path.stem)}]({path.name})")
    labs = sorted((NOTEBOOKS / "labs").glob("[0-9][0-9]_*.ipynb"))
    if labs:
        nav.append("* Labs (learner versions)")
    for path in labs:
        nb = site_notebook(path)
        with mkdocs_gen_files.open(f"notebooks/labs/{path.name}", "w") as f:
            nbformat.write(nb, f)
        nav.append(f"    * [{notebook_title(nb, path.stem)}](labs/{path.name})")
    with mkdocs_gen_files.open("notebooks/SUMMARY.md", "w") as f:
        f.write("\n".join(nav) + "\n")
    plotly_js = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    with mkdocs_gen_files.open(PLOTLY_JS, "w") as f:
        f.write(plotly_js.read_text(encoding="utf-8"))


# --- results -----------------------------------------------------------------------------
def cell(value) -> str:
    """One table cell: numbers as they are, lists joined, anything nested as short JSON."""
    if isinstance(value, float):
        text = f"{value:.4g}" if abs(value) < 1e5 else f"{value:,.0f}"
    elif isinstance(value, list) and all(not isinstance(v, dict | list) for v in value):
        text = ", ".join(cell(v) for v in value) if len(value) <= 12 else f"{len(value)} values"
    elif isinstance(value, dict | list):
        text = json.dumps(value)
        text = text if len(text) <= 80 else text[:77] + "..."
    else:
        text = str(value)
    return html.escape(text).replace("|", "&#124;").replace("\n", " ")


def table(rows: dict[str, dict] | list[dict], first: str = "", limit: int = 40) -> list[str]:
    items = list(rows.items()) if isinstance(rows, dict) else [(None, r) for r in rows]
    columns: list[str] = []
    for _, row in items:
        columns += [k for k in row if k not in columns]
    head = ([first] if isinstance(rows, dict) else []) + columns
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for key, row in items[:limit]:
        start = [cell(key)] if isinstance(rows, dict) else []
        lines.append("| " + " | ".join(start + [cell(row.get(c, "")) for c in columns]) + " |")
    if len(items) > limit:
        lines.append(f"\n({len(items) - limit} more rows in the raw file)")
    return lines + [""]


def render(data: dict, level: int = 0) -> list[str]:
    """A result's fields: scalars as a list, lists of records and records of records as
    tables, anything else one level down."""
    lines, facts = [], []
    for key, value in data.items():
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            lines += [f"**{key}**", "", *table(value)]
        elif (
            isinstance(value, dict)
            and value
            and all(isinstance(v, dict) for v in value.values())
            and level < 2
        ):
            lines += [f"**{key}**", "", *table(value, first=key)]
        elif isinstance(value, dict) and value and level < 2:
            lines += [f"**{key}**", "", *render(value, level + 1)]
        else:
            facts.append(f"- {key}: {cell(value)}")
    return (facts + [""] if facts else []) + lines


def profile_summary(data: dict) -> list[str]:
    """kvlab profile's steps summed by phase and part; vLLM's run beside it if present."""
    steps = data["steps"]
    parts = [k[: -len(" ms")] for k in steps[0] if k.endswith(" ms")]
    prompt_steps = max((i + 1 for i, s in enumerate(steps) if s["phase"] != "decode"), default=0)
    decode = steps[prompt_steps:]
    phases = {
        "prompt phase": {"steps": prompt_steps, "kvlab s": sum_s(steps[:prompt_steps])},
        "decode phase": {"steps": len(decode), "kvlab s": sum_s(decode)},
        "whole run": {"steps": len(steps), "kvlab s": sum_s(steps)},
    }
    lines = ["**kvlab's run by phase** (the prompt phase ends with the last prefill step)", ""]
    lines += table(phases, first="phase")
    per_part = {
        part: {
            "whole run s": sum(s[f"{part} ms"] for s in steps) / 1e3,
            "mean decode step ms": sum(s[f"{part} ms"] for s in decode) / max(1, len(decode)),
        }
        for part in parts
    }
    per_part["step"] = {
        "whole run s": sum_s(steps),
        "mean decode step ms": sum(s["step_ms"] for s in decode) / max(1, len(decode)),
    }
    lines += ["**kvlab's parts**", "", *table(per_part, first="part")]
    floor = data.get("floor", {})
    if floor:
        rates = floor.get("rates", {})
        lines += [
            "**The decode floor on this machine** (bytes a mean decode step must read over "
            "the copy bandwidth; its FLOPs over the matmul rate)",
            "",
            f"- sequences per decode step: {cell(floor.get('batch_seqs'))}",
            f"- bandwidth floor: {cell(floor.get('bandwidth_ms'))} ms at "
            f"{cell(rates.get('bandwidth_gb_s'))} GB/s; compute floor: "
            f"{cell(floor.get('compute_ms'))} ms at {cell(rates.get('matmul_gflop_s'))} GFLOP/s",
            "",
        ]
    run = data.get("vllm", {}).get("run")
    if run:
        ops = {op["op"]: {"calls": op["calls"], "self s": op["self_ms"] / 1e3} for op in run["ops"]}
        system = data["vllm"].get("meta", {}).get("system", "vllm")  # how it ran
        lines += [
            f"**vLLM's run, as {cell(system)}** ({cell(run.get('steps'))} steps, "
            f"run_s {cell(run.get('run_s'))}, "
            f"step times summed {sum(r['step_ms'] for r in run['step_rows']) / 1e3:.1f} s; "
            "its top operators by self time, from torch's profiler)",
            "",
            *table(dict(list(ops.items())[:8]), first="operator"),
        ]
    return lines


def sum_s(steps: list[dict]) -> float:
    return sum(s["step_ms"] for s in steps) / 1e3


def result_section(path: Path) -> list[str]:
    data = json.loads(path.read_text(encoding="utf-8"))
    prov = data.pop("provenance", {})
    lines = [f"### {path.name}", ""]
    lines += [
        f"- **{key.replace('_', ' ')}**: {cell(prov.get(key, 'not recorded'))}"
        for key in PROVENANCE
    ]
    lines += [
        f"- **{k.replace('_', ' ')}**: {cell(v)}" for k, v in prov.items() if k not in PROVENANCE
    ]
    lines += [f"- raw file: [{path.name}](results/{path.name})", ""]
    if "steps" in data and isinstance(data["steps"], list) and data["steps"]:
        lines += profile_summary(data)
        data = {k: v for k, v in data.items() if k not in ("steps", "floor", "vllm")}
    lines += render(data)
    return lines


def write_results() -> None:
    paths = sorted(RESULTS.glob("*.json"))
    index: dict[str, dict[str, str]] = {}
    for path in paths:
        name, _, klass = path.stem.rpartition(".")
        name, klass = (name, klass) if name else (klass, "not recorded")
        index.setdefault(name, {})[klass] = f"[{path.name}](#{anchor(path.name)})"
    classes = sorted({k for row in index.values() for k in row})
    lines = [
        "# Results",
        "",
        "Every file in `benchmarks/results/`, read when this site was built: one current",
        "file per benchmark and machine class, named `<benchmark>.<machine class>.json`",
        "(older runs are in git history). Each names the machine, its CPU flags, the date,",
        "the command and the rounds it ran (`provenance`); fields a run did not record say",
        "so. The machine classes: **avx2**, a 2-core AMD EPYC VM with AVX2 and FMA and no",
        "AVX-512; **avx512**, a 2-core x86-64 VM with AVX-512 and AVX512-BF16; **unrecorded**,",
        "a run whose CPU was not written down. Timings on these shared 2-core machines move",
        "with their load; token counts, hit counts and capacities do not.",
        "",
        "A system is named as it ran wherever that is not its defaults: `vllm` is vLLM",
        "compiled at its own block size (128), `vllm (eager)` the same without compiling,",
        "`vllm (eager, block 32)` eager at kvlab's block size 32 (every run before",
        "2026-12-05), and `hf-generate-batch (7 pages)` transformers' continuous batching",
        "in a pool too small for every request at once. A file's `relabelled` line says",
        "what was renamed and why.",
        "",
        "| benchmark | " + " | ".join(classes) + " |",
        "| --- |" + " --- |" * len(classes),
    ]
    for name, row in index.items():
        lines.append(f"| {name} | " + " | ".join(row.get(k, "") for k in classes) + " |")
    lines.append("")
    for path in paths:
        lines += result_section(path)
        with mkdocs_gen_files.open(f"results/{path.name}", "w") as f:
            f.write(path.read_text(encoding="utf-8"))
    with mkdocs_gen_files.open("results.md", "w") as f:
        f.write("\n".join(lines) + "\n")


def anchor(name: str) -> str:
    """The id the toc extension gives a heading: lower case, word characters and dashes."""
    return re.sub(r"[^\w-]", "", name.lower())


def main() -> None:
    write_notebooks()
    write_results()


main()
