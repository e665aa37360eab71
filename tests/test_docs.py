"""The documentation: the site builds strictly, a page of it renders in a real browser, the
README stays a guide, every result file says where it came from, and the docs name files
that exist.

The site (mkdocs.yml, docs/) is built once for this module with `mkdocs build --strict`
into a temporary folder: a broken link, a missing page, an API object that no longer
exists or a notebook that cannot be converted fails the build. The browser test serves the
built site on 127.0.0.1 and opens a rendered notebook (its plotly figures drawn by the
plotly.js the site serves: nothing comes from the network) and the API page; it uses the
same Debian chromium as tests/test_browser.py and skips, saying why, where that is missing.
"""

from __future__ import annotations

import functools
import http.server
import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import CHROMIUM

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PROVENANCE = ("benchmark", "machine_class", "machine", "cpu_flags", "date", "command", "rounds")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-background-networking", "--disable-component-update"]
BUILD_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed: pip install -e .[docs] (make setup does)")
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, DISABLE_MKDOCS_2_WARNING="true", NO_MKDOCS_2_WARNING="1")
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
    )
    assert build.returncode == 0, f"mkdocs build --strict failed:\n{build.stderr[-6000:]}"
    return out


def test_site_builds_strictly(site):
    assert (site / "index.html").exists()
    assert (site / "results" / "index.html").exists()
    notebooks = sorted(p.stem for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert notebooks and all((site / "notebooks" / n / "index.html").exists() for n in notebooks)
    for page in (site / "results" / "index.html", site / "api" / "engine" / "index.html"):
        assert "<h1" in page.read_text(encoding="utf-8")


def test_site_loads_nothing_from_the_network(site):
    """No script, stylesheet or font from another host: the site works offline."""
    remote = re.compile(r"""<(?:script|link)[^>]+(?:src|href)=["']https?://""")
    for page in site.rglob("*.html"):
        assert not remote.search(page.read_text(encoding="utf-8")), page.relative_to(site)


def test_results_name_their_benchmark_machine_and_run():
    """benchmarks/results/: <benchmark>.<machine class>.json, each with its provenance."""
    paths = sorted(RESULTS.glob("*.json"))
    assert paths
    for path in paths:
        assert re.fullmatch(r"[a-z0-9_]+\.[a-z0-9_-]+\.json", path.name), (
            f"{path.name}: name it <benchmark>.<machine class>.json (one current file per "
            "benchmark and class of machine; git history keeps older runs)"
        )
        provenance = json.loads(path.read_text(encoding="utf-8")).get("provenance", {})
        missing = [key for key in PROVENANCE if key not in provenance]
        assert not missing, (
            f"{path.name}: its provenance lacks {missing} (write 'not recorded' where a run "
            "did not record it; benchmarks/stamp.py adds the block)"
        )
        assert provenance["machine_class"] == path.name.split(".")[-2], path.name


def test_readme_is_a_guide():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) < 250, f"README.md has {len(lines)} lines: move detail into docs/"
    text = "\n".join(lines)
    assert "make lab" in text and "make test" in text


PATH = re.compile(r"`((?:kvlab|kernels|tests|benchmarks|notebooks|docs)/[\w./-]+)`")


def test_docs_name_files_that_exist():
    """A path the docs put in backticks (kvlab/engine/core.py, tests/test_x.py, ...) exists."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    missing = []
    for page in pages:
        for path in PATH.findall(page.read_text(encoding="utf-8")):
            path = path.rstrip(".")
            if re.search(r"NN|[*{<]", path):  # a pattern such as notebooks/NN_*.ipynb
                continue
            if not (ROOT / path).exists():
                missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert not missing, "the docs name files that do not exist:\n" + "\n".join(missing)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def served(site):
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_site_pages_render_in_a_browser(served):
    """A rendered notebook draws its plotly figures; the API page shows kvlab.Engine."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:  # pragma: no cover - depends on the machine
        pytest.skip("the Python package `playwright` is not installed: pip install playwright")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no chromium at {CHROMIUM}: apt-get install -y chromium (as root)")
    notebook = sorted((ROOT / "notebooks").glob("02_*.ipynb"))[0].stem
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda error: errors.append(str(error)))
            requests: list[str] = []
            page.on("request", lambda request: requests.append(request.url))
            page.goto(f"{served}/notebooks/{notebook}/", wait_until="load")
            assert "02" in page.title()
            page.wait_for_selector(".plotly-graph-div svg.main-svg", timeout=60_000)
            figures = page.locator(".plotly-graph-div").count()
            drawn = page.locator(".plotly-graph-div:has(svg.main-svg)").count()
            assert figures >= 1 and drawn == figures, (figures, drawn)
            assert not errors, errors
            assert all(url.startswith((served, "data:")) for url in requests), requests
            page.goto(f"{served}/api/kvlab/", wait_until="load")
            assert page.locator("h2#kvlab\\.build\\.Engine").count() == 1
        finally:
            browser.close()
