"""Figures the docs quote from a saved run agree with the file that holds it
(tests/quoted_figures.py: the markers, how a value is found, `--update`).

The first test reads every marker of README.md and docs/; the second makes sure the
kvlab-against-peer ratios in the docs' tables carry one; the rest check the mechanism on
pages and files made here.
"""

from __future__ import annotations

import json
import re

import pytest
from quoted_figures import ROOT, QuoteError, check, pages, quotes, resolve, update


def test_every_quoted_figure_agrees_with_its_file():
    every, problems = check()
    assert every, "no quoted figures found: the markers are gone"
    assert not problems, (
        "quoted figures that disagree with their files (re-run a benchmark? then "
        "`python tests/quoted_figures.py --update` and read the sentences around them):\n"
        + "\n".join(problems)
    )


RATIO = re.compile(r"(?<![\w.])\d+\.\d+x(?!\w)")
PEERS = re.compile(r"vLLM|vllm|HF|hf-generate")


def test_ratios_against_peers_are_quoted_from_files():
    """In a table that puts kvlab beside vLLM or HF, every ratio ("1.16x") is marked."""
    unmarked = []
    for page in pages():
        lines = page.read_text(encoding="utf-8").splitlines()
        header = ""
        for number, line in enumerate(lines, 1):
            if not line.startswith("|"):
                header = ""
                continue
            header = header or line
            if line is header or not PEERS.search(header + line):
                continue
            for ratio in RATIO.finditer(line):
                if not line[ratio.end() :].lstrip("*").startswith("<!-- q:"):
                    unmarked.append(f"{page.relative_to(ROOT)}:{number}: {ratio.group()}")
    assert not unmarked, "ratios beside a peer without a marker:\n" + "\n".join(unmarked)


def write(tmp_path, name: str, data) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(data), encoding="utf-8")
    return str(path)  # absolute: read as it is


def test_a_figure_agrees_at_the_digits_it_shows(tmp_path):
    source = write(tmp_path, "run.avx2.json", {
        "median_ratios": {"kvlab/vllm": 0.745},
        "systems": {"vllm (eager)": {"tok_s": 1075.6}},
        "share": 0.45,
    })  # fmt: skip
    page = tmp_path / "page.md"
    page.write_text(
        f'kvlab 0.74x<!-- q: {source} median_ratios["kvlab/vllm"] --> and '
        f'**0.75x**<!-- q: {source} .median_ratios["kvlab/vllm"] -->\n'
        f'| 1,076 tok/s<!-- q: {source} systems["vllm (eager)"].tok_s --> | '
        f"-45%<!-- q: {source} share *-100 --> |\n"
        f'0.76x<!-- q: {source} median_ratios["kvlab/vllm"] --> is wrong\n',
        encoding="utf-8",
    )
    found = quotes(page)
    assert [q.text for q in found] == ["0.74", "0.75", "1,076", "-45", "0.76"]
    assert [q.line for q in found] == [1, 1, 2, 2, 3]
    assert [q.agrees() for q in found] == [True, True, True, True, False]
    every, problems = check([page])
    assert len(every) == 5 and len(problems) == 1
    assert "page.md:3: quotes 0.76" in problems[0] and "holds 0.74" in problems[0]


def test_a_range_is_two_figures_and_a_sign_is_kept(tmp_path):
    source = write(tmp_path, "times.json", {"rows": [{"n": "a", "s": 3.1}, {"n": "b", "s": 7.3}]})
    page = tmp_path / "page.md"
    page.write_text(
        f"ran in 3.1<!-- q: {source} rows[n=a].s -->-7.3<!-- q: {source} rows[n=b].s --> s",
        encoding="utf-8",
    )
    assert [q.quoted for q in quotes(page)] == [3.1, 7.3]


def test_records_regexes_and_notebooks(tmp_path):
    notebook = {
        "cells": [
            {"cell_type": "markdown", "source": ["# title"]},
            {
                "cell_type": "code",
                "source": ["copy = copy_times(model)\n", "print(copy)"],
                "outputs": [{"output_type": "stream", "name": "stdout",
                             "text": ["  device_to_host   469 µs per block\n"]}],
            },
            {
                "cell_type": "code",
                "source": ["ttft_figure(ttft)"],
                "outputs": [{"output_type": "display_data", "data": {
                    "application/vnd.plotly.v1+json": {"data": [{"y": [204.3, 755.0]}]},
                    "text/plain": ["Figure"]}}],
            },
        ]
    }  # fmt: skip
    source = write(tmp_path, "nb.ipynb", notebook)
    assert resolve(source, r"cells[source~copy_times].text/device_to_host +(\d+)/") == 469
    assert resolve(source, 'cells[source~"ttft_figure("].figures[0].data[0].y[1]') == 755
    runs = write(tmp_path, "runs.json", {"runs": [
        {"system": "vllm (eager, block 32)", "k": 4, "speedup": 1.225},
        {"system": "kvlab", "k": 4, "speedup": 1.333},
    ]})  # fmt: skip
    assert resolve(runs, 'runs[system="vllm (eager, block 32)", k=4].speedup') == 1.225
    assert resolve(runs, "runs[system~kv].speedup") == 1.333
    assert resolve(runs, 'runs[system~kv]["speedup"]') == resolve(runs, "runs.1.speedup")
    with pytest.raises(QuoteError, match="matches 2 records"):
        resolve(runs, "runs[k=4].speedup")
    with pytest.raises(QuoteError, match="no '.tok_s' there"):
        resolve(runs, "runs[1].tok_s")
    with pytest.raises(QuoteError, match="not a number"):
        resolve(runs, "runs[0].system")
    with pytest.raises(QuoteError, match="no such file"):
        resolve(str(tmp_path / "gone.json"), "x")


def test_markers_that_cannot_be_read_are_problems(tmp_path):
    source = write(tmp_path, "r.json", {"a": 1.5})
    page = tmp_path / "page.md"
    page.write_text(f"no number<!-- q: {source} a -->\n", encoding="utf-8")
    assert "no number before it" in check([page])[1][0]
    page.write_text(f"| 1.5<!-- q: {source} /a|b/ --> |\n", encoding="utf-8")
    assert "splits a table's cell" in check([page])[1][0]
    page.write_text(f"1.5<!-- q: {source} b -->\n", encoding="utf-8")
    assert "no 'b' there" in check([page])[1][0]
    page.write_text(f'1.5<!-- q: {source} ["a"][0] -->\n', encoding="utf-8")
    assert "write .N for [N]" in check([page])[1][0]


def test_update_rewrites_figures_from_their_files(tmp_path):
    source = write(tmp_path, "new.json", {"r": 0.8126, "n": 20480.4})
    page = tmp_path / "page.md"
    page.write_text(
        f"kvlab 0.74x<!-- q: {source} r --> of vLLM over 1,076<!-- q: {source} n --> tokens\n",
        encoding="utf-8",
    )
    assert update([page]) == [
        f"{page}:1: 0.74 -> 0.81",
        f"{page}:1: 1,076 -> 20,480",
    ]
    assert page.read_text(encoding="utf-8").startswith("kvlab 0.81x<!-- q:")
    assert "over 20,480<!--" in page.read_text(encoding="utf-8")
    assert check([page])[1] == [] and update([page]) == []
