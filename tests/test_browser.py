"""Every notebook in a real browser: JupyterLab + Debian's chromium, driven by playwright.

A notebook that passes nbval can still be broken where people use it, so this test does
what a student does, for every top-level notebook (notebooks/NN_*.ipynb, found by a glob,
so a new notebook is covered as it lands): it starts JupyterLab on 127.0.0.1 (a free port,
a token), opens the notebook, runs Run > Run All Cells, waits for the kernel to go idle,
saves the notebook from the browser, and checks that
- no cell shows a traceback and the saved file records no error;
- the saved outputs equal the committed ones as nbval judges them (tests/nbval_check.py:
  nbval's comparison, markers and notebooks/sanitize.cfg), so this run is also the
  notebook's nbval run (tests/conftest.py leaves nbval's own second run of it out);
- every plotly figure the saved file records (plain, or the figure of a widget app) was
  drawn on the page (an svg.main-svg in it);
- in every widget app (each ipywidgets output), moving its first control (a slider with
  the keyboard, a dropdown to the option before) redraws the plotly figure beside it,
  pressing the app's Run button when the move alone redraws nothing (the dashboard); the
  figure is compared once the kernel has handled the move (an empty execute queued behind
  it has finished), so the screenshot shows the app's final state, not a half-way one;
- every plotly animation (a figure with a plotly slider) shows another frame when its
  slider's rail is clicked.
One screenshot per notebook goes to docs/screenshots/ (<notebook stem>.png unless
SCREENSHOT_NAMES says otherwise): the first widget app's output area after its control
moved; in a notebook without widgets, its first animation after the step, or else its
first plotly figure. The page is 1600 px wide: the dashboard's 1000 px figure and its
legend fit beside the prompts.

It works on copies of the notebooks (outputs cleared) in a temporary mirror of the
repository (notebooks/ holds the copies; every other top-level folder is a symlink, so
relative paths such as ../benchmarks/results resolve), with its own JupyterLab settings,
so the committed notebooks are never touched; the JupyterLab process group (server and
kernels) is always killed at the end. A worker's notebooks take turns in one browser page
(`Tab`): JupyterLab's front end loads once, not once per notebook.

Needs Debian's `chromium` (apt-get install -y chromium) and the Python `playwright`
package; it skips, saying so, where either is missing. Never run `playwright install`:
it downloads a browser. Environment: KVLAB_CHROMIUM (browser path);
KVLAB_BROWSER_CELL_TIMEOUT (seconds Run All may go without finishing a cell, and a widget
app may take to redraw, default 900) and KVLAB_BROWSER_TIMEOUT (seconds for one
notebook's whole Run All, default 2400): a slow, shared machine gets time as long as cells
keep finishing, a hung kernel fails in bounded time.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest
from conftest import CHROMIUM
from nbval_check import output_differences

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())
NOTEBOOKS = ROOT / "notebooks"
SCREENSHOTS = ROOT / "docs" / "screenshots"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
PANEL = ".jp-NotebookPanel:visible"  # the notebook on screen (playwright's :visible)
CELL_TIMEOUT_S = float(os.environ.get("KVLAB_BROWSER_CELL_TIMEOUT", "900"))
RUN_ALL_TIMEOUT_S = float(os.environ.get("KVLAB_BROWSER_TIMEOUT", "2400"))
REDRAW_TIMEOUT_S = 300.0  # after the kernel is idle, for a late control's redraw
NAMES = sorted(p.name for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))  # every top-level one
SCREENSHOT_NAMES = {"02_paged_vs_naive.ipynb": "02_paged_vs_naive_block_map.png"}  # else stem
PLOTLY_MIME = "application/vnd.plotly.v1+json"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
CONTROLS = ".widget-slider, .widget-dropdown"  # the kinds of control an app's first may be
# JupyterLab user settings: every cell in the DOM (no windowing), no news or update
# pop-ups over the screenshots, and no autosave: on a busy machine an autosave's slow PUT
# leaves the page's idea of the file's time behind the disk's, and the next save opens a
# "File Changed" dialog over the page (jupyterlab#7743). The test saves once, with Ctrl+S.
SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false",
        "checkForUpdates": False,
    },
}

pytestmark = pytest.mark.slow  # the kernels load the real model

try:
    from playwright.sync_api import Error as PlaywrightError
    from playwright.sync_api import sync_playwright
except ImportError:  # pragma: no cover - depends on the machine
    sync_playwright = None
    PlaywrightError = Exception


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class JupyterLab:
    """A JupyterLab server in its own process group, on copies of the notebooks."""

    def __init__(self, root: Path):
        self.root, self.port, self.token = root, _free_port(), secrets.token_hex(16)
        self.base = f"http://127.0.0.1:{self.port}"
        for path, value in SETTINGS.items():
            target = root / ".lab" / "settings" / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(json.dumps(value))
        env = dict(
            os.environ,
            JUPYTER_CONFIG_DIR=str(root / ".lab" / "config"),
            JUPYTER_RUNTIME_DIR=str(root / ".lab" / "runtime"),
            IPYTHONDIR=str(root / ".lab" / "ipython"),
        )
        self.log = (root / ".lab" / "server.log").open("w")
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jupyterlab",
                "--no-browser",
                "--ServerApp.ip=127.0.0.1",
                f"--ServerApp.port={self.port}",
                "--ServerApp.port_retries=0",
                f"--IdentityProvider.token={self.token}",
                f"--ServerApp.root_dir={root}",
                f"--LabApp.user_settings_dir={root / '.lab' / 'settings'}",
                f"--LabApp.workspaces_dir={root / '.lab' / 'workspaces'}",
                "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
                "--LabApp.expose_app_in_browser=True",  # window.jupyterapp: KERNEL_DONE_JS
                *(["--allow-root"] if os.geteuid() == 0 else []),  # CI containers run as root
            ],
            cwd=root,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: the kernels die with it
        )

    def wait_ready(self, timeout_s: float = 90) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"JupyterLab exited early:\n{self.server_log()}")
            try:
                url = f"{self.base}/api/status?token={self.token}"
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"JupyterLab did not answer in {timeout_s:.0f} s:\n{self.server_log()}")

    def shut_down_kernels(self) -> None:
        """End every session and its kernel: each holds a model, and twelve would not fit."""
        headers = {"Authorization": f"token {self.token}"}
        listing = urllib.request.Request(f"{self.base}/api/sessions", headers=headers)
        with urllib.request.urlopen(listing, timeout=30) as response:
            sessions = json.load(response)
        for session in sessions:
            url = f"{self.base}/api/sessions/{session['id']}"
            request = urllib.request.Request(url, headers=headers, method="DELETE")
            urllib.request.urlopen(request, timeout=60).close()

    def server_log(self) -> str:
        self.log.flush()
        return (self.root / ".lab" / "server.log").read_text()[-3000:]

    def stop(self) -> None:
        """Kill the server and its kernels (its whole process group), whatever happened."""
        if self.process.poll() is None:
            for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
                try:
                    os.killpg(self.process.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.process.wait(timeout=wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
        try:  # kernels left in the group after the server itself exited
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.log.close()


# Close every notebook in the page as it is (no "save your changes?" dialog).
CLOSE_JS = """() => {
  for (const widget of Array.from(window.jupyterapp.shell.widgets('main'))) {
    if (widget.context) widget.context.model.dirty = false;
    widget.dispose();
  }
}"""

OPEN_JS = """(path) => window.jupyterapp.commands.execute(
  'docmanager:open', {path, factory: 'Notebook'}).then(() => null)"""

# The current notebook is `path` and its kernel is idle (started, nothing queued).
READY_JS = """(path) => {
  const widget = window.jupyterapp.shell.currentWidget;
  const kernel = widget && widget.sessionContext && widget.sessionContext.session
    && widget.sessionContext.session.kernel;
  return !!kernel && widget.context.path === path && kernel.status === 'idle';
}"""


class Tab:
    """The browser page a worker's notebooks take turns in.

    Loading JupyterLab's front end costs chromium ~5 CPU-seconds on a 2-core machine, so
    the page loads it once and opens each next notebook in it after closing the last one.
    A notebook whose check failed takes the page with it: the next starts on a fresh one.
    """

    def __init__(self, server: JupyterLab, browser):
        self.server, self.browser, self.page = server, browser, None
        self.errors: list[str] = []  # the page's console errors, for a failure's message

    def open(self, name: str):
        """The page, showing notebooks/`name` with its kernel started and idle."""
        path = f"notebooks/{name}"
        if self.page is None:
            self.page = self.browser.new_page(viewport={"width": 1600, "height": 1800})
            self.page.set_default_timeout(60_000)
            self.errors = []
            self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
            self.page.on("pageerror", lambda error: self.errors.append(str(error)))
            # A workspace of its own: JupyterLab would otherwise reopen the notebooks
            # of earlier pages as hidden tabs beside this one.
            workspace = Path(name).stem
            self.page.goto(
                f"{self.server.base}/lab/workspaces/{workspace}/tree/{path}"
                f"?token={self.server.token}"
            )
        else:
            self.page.evaluate(OPEN_JS, path)
        self.page.wait_for_selector(f"{PANEL} .jp-Cell", timeout=90_000)
        self.page.wait_for_function(READY_JS, arg=path, timeout=120_000)
        return self.page

    def close(self, passed: bool) -> None:
        """Close the notebook, and the page too unless the notebook's check passed (or the
        notebook would not close)."""
        if self.page is None:
            return
        if passed:
            try:
                self.page.evaluate(CLOSE_JS)
                return
            except PlaywrightError:
                pass
        self.page.close()
        self.page = None


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    if sync_playwright is None:
        pytest.skip(
            "the Python package `playwright` is not installed: pip install playwright "
            "(then use Debian's chromium; never `playwright install`)"
        )
    if not Path(CHROMIUM).exists():
        pytest.skip(
            f"no chromium at {CHROMIUM}: apt-get install -y chromium (as root), "
            "or set KVLAB_CHROMIUM to a Chromium binary"
        )
    root = tmp_path_factory.mktemp("lab")
    for entry in ROOT.iterdir():  # the repository, read through symlinks ...
        if entry.name not in {"notebooks", ".git", ".venv"}:
            (root / entry.name).symlink_to(entry)
    (root / "notebooks").mkdir()
    for entry in NOTEBOOKS.iterdir():  # ... except notebooks and their jupytext pairs
        if entry.suffix not in {".ipynb", ".py"} and entry.name != "labs":
            (root / "notebooks" / entry.name).symlink_to(entry)
    for name in NAMES:  # a copy with outputs cleared: prompts start at [ ]
        nb = nbformat.read(NOTEBOOKS / name, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                cell.outputs, cell.execution_count = [], None
        nb.metadata.pop("widgets", None)
        nb.metadata.pop("jupytext", None)  # saving must not write a paired .py
        nbformat.write(nb, root / "notebooks" / name)
    server = JupyterLab(root)
    try:
        server.wait_ready()
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                yield server, Tab(server, browser)
            finally:
                browser.close()
    finally:
        server.stop()


# --- driving the notebook -------------------------------------------------------------------
PROGRESS_JS = """() => {
  const prompts = Array.from(document.querySelectorAll('.jp-CodeCell .jp-InputPrompt'))
    .map(p => p.innerText.trim());
  const indicator = document.querySelector('.jp-Notebook-ExecutionIndicator');
  return {
    prompts,
    status: indicator ? indicator.getAttribute('data-status') : null,
  };
}"""

# An empty execute queued behind what the page sent the kernel (a widget's new value, a
# button's click): it finishes once the kernel handled all of it. The status bar's Busy/Idle
# is no such sign: with a plotly FigureWidget on the page it reads Idle while a widget's
# callback still runs.
KERNEL_DONE_JS = """async (timeoutMs) => {
  const kernel = window.jupyterapp.shell.currentWidget.sessionContext.session.kernel;
  const done = kernel.requestExecute({code: '', silent: true, store_history: false}).done;
  const late = new Promise((_, reject) => setTimeout(
    () => reject(new Error(`the kernel was still busy after ${timeoutMs / 1000} s`)), timeoutMs));
  await Promise.race([done, late]);
}"""

FIGURES_JS = """(cell) => Array.from(cell.querySelectorAll('.js-plotly-plot')).map(gd => {
  let data = '';
  try {
    data = JSON.stringify((gd.data || []).map(t => [t.type, t.name, t.x, t.y, t.z, t.text]))
      + JSON.stringify(gd.layout ? gd.layout.title : null);
  } catch (error) { data = String(error); }
  const svg = Array.from(gd.querySelectorAll('svg.main-svg')).map(s => s.innerHTML).join('');
  return data + '|' + svg;
})"""

TITLES_JS = """(cell) => Array.from(cell.querySelectorAll('.js-plotly-plot')).map(gd =>
  gd.layout && gd.layout.title ? String(gd.layout.title.text) : '')"""

DRAWN_JS = """(panel) => Array.from(panel.querySelectorAll('.jp-Cell')).map(cell =>
  Array.from(cell.querySelectorAll('.js-plotly-plot'))
    .filter(gd => gd.querySelector('svg.main-svg') !== null).length)"""


def _run_all(page) -> list[str]:
    """Run > Run All Cells, then wait until every code cell ran and the kernel is idle.

    Waits as long as cells keep finishing (CELL_TIMEOUT_S without progress fails), up to
    RUN_ALL_TIMEOUT_S in all.
    """
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
    started = last_progress = time.monotonic()
    ran, calm, prompts = False, 0, []
    while True:
        now = time.monotonic()
        progress = page.evaluate(PROGRESS_JS)
        if progress["prompts"] != prompts:
            prompts, last_progress = progress["prompts"], now
        busy = any("*" in p for p in prompts) or progress["status"] == "busy"
        ran = ran or busy or any(any(ch.isdigit() for ch in p) for p in prompts)
        calm = calm + 1 if ran and not busy else 0
        if calm >= 3:  # idle for three polls in a row (no cell queued: no "*" prompt)
            return prompts
        if now - last_progress > CELL_TIMEOUT_S or now - started > RUN_ALL_TIMEOUT_S:
            raise AssertionError(
                f"Run All stalled: no cell finished for {now - last_progress:.0f} s "
                f"({now - started:.0f} s in all; limits KVLAB_BROWSER_CELL_TIMEOUT="
                f"{CELL_TIMEOUT_S:.0f}, KVLAB_BROWSER_TIMEOUT={RUN_ALL_TIMEOUT_S:.0f}); "
                f"prompts: {prompts}"
            )
        time.sleep(0.5)


def _save(page, server: JupyterLab, name: str) -> nbformat.NotebookNode:
    """Save the notebook from the browser (Ctrl+S) and read back what the file records."""
    path = server.root / "notebooks" / name
    before = path.stat().st_mtime_ns
    page.locator(f"{PANEL} .jp-Notebook").first.click(position={"x": 5, "y": 5})
    page.keyboard.press("Control+s")
    deadline = time.monotonic() + 30
    while path.stat().st_mtime_ns == before and time.monotonic() < deadline:
        time.sleep(0.3)
    assert path.stat().st_mtime_ns != before, "the notebook was not saved (Ctrl+S)"
    while True:  # Jupyter writes the file in place (a backup beside it): it may be mid-write
        try:
            return nbformat.read(path, as_version=4)
        except nbformat.reader.NotJSONError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)


def _errors(nb: nbformat.NotebookNode) -> list[str]:
    return [
        f"cell {i}: {out.get('ename')}: {out.get('evalue')}\n  {cell.source[:200]}"
        for i, cell in enumerate(nb.cells)
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
        if out.get("output_type") == "error"
    ]


def _outputs(cell, mime: str) -> int:
    """How many of the cell's saved outputs carry `mime`."""
    return sum(mime in out.get("data", {}) for out in cell.get("outputs", []))


def _check_figures_drawn(page, nb: nbformat.NotebookNode, timeout_s: float = 60) -> int:
    """Each cell draws as many plotly figures as its saved outputs hold (one per widget app)."""
    expected = {
        i: _outputs(cell, PLOTLY_MIME) + _outputs(cell, WIDGET_MIME)
        for i, cell in enumerate(nb.cells)
    }
    cells = page.locator(f"{PANEL} .jp-Cell")
    assert cells.count() == len(nb.cells), (
        f"{cells.count()} cells on the page, {len(nb.cells)} saved"
    )
    deadline = time.monotonic() + timeout_s
    while True:
        drawn = page.locator(PANEL).first.evaluate(DRAWN_JS)
        missing = {i: f"{drawn[i]} of {n}" for i, n in expected.items() if drawn[i] < n}
        if not missing:
            return sum(expected.values())
        assert time.monotonic() < deadline, (
            f"plotly figures not drawn (cell: drawn of saved): {missing}"
        )
        for i in missing:  # a figure may wait to be on screen before it draws
            cells.nth(i).scroll_into_view_if_needed()
        time.sleep(1.0)


def _move_slider(page, slider) -> str:
    """Focus the slider's handle and press arrow keys; return how the readout moved."""
    handle = slider.locator(".noUi-handle").first
    readout = slider.locator(".widget-readout").first
    handle.scroll_into_view_if_needed()
    before = readout.inner_text() if readout.count() else ""
    for key in ("ArrowLeft", "ArrowRight"):  # left first; right if it sat at its minimum
        handle.focus()
        page.keyboard.press(key)  # one step: an app recomputes on every step it is given
        time.sleep(0.3)
        after = readout.inner_text() if readout.count() else ""
        if after != before:
            return f"slider {before} -> {after}"
    box = handle.bounding_box()  # keyboard did nothing: drag it instead
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    page.mouse.down()
    page.mouse.move(box["x"] - 60, box["y"] + box["height"] / 2, steps=8)
    page.mouse.up()
    after = readout.inner_text() if readout.count() else ""
    assert after != before, f"the slider did not move (readout stayed {before!r})"
    return f"slider {before} -> {after} (dragged)"


def _pick_in_dropdown(dropdown) -> str:
    """Select the option before the current one (the next one if it is the first)."""
    select = dropdown.locator("select").first
    select.scroll_into_view_if_needed()
    options = select.locator("option").all_inner_texts()
    assert len(options) > 1, f"a dropdown with one option: {options}"
    index = select.evaluate("s => s.selectedIndex")
    other = index - 1 if index > 0 else index + 1
    select.select_option(index=other)
    return f"dropdown {options[index]} -> {options[other]}"


def _move_first_control(page, cell) -> str:
    control = cell.locator(CONTROLS).first
    assert control.count(), "a widget app with no slider or dropdown"
    if "widget-dropdown" in (control.get_attribute("class") or ""):
        return _pick_in_dropdown(control)
    return _move_slider(page, control)


def _click_plotly_slider(page, cell) -> str:
    """Click the rail of the cell's first plotly slider three quarters along, or a quarter
    along where the slider already stood three quarters along."""
    rail = cell.locator(".slider-container .slider-rail-touch-rect").first
    rail.scroll_into_view_if_needed()
    label = cell.locator(".slider-group > text.slider-label").first  # its current value
    before = label.text_content() if label.count() else ""
    box = rail.bounding_box()
    for along in (0.75, 0.25):
        page.mouse.click(box["x"] + along * box["width"], box["y"] + box["height"] / 2)
        time.sleep(0.5)
        after = label.text_content() if label.count() else ""
        if after != before:
            break
    return f"plotly slider {before!r} -> {after!r}"


def _wait_for_change(cell, before: list[str], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cell.evaluate(FIGURES_JS) != before:
            return True
        time.sleep(0.5)
    return False


def _redrawn(page, cell, before: list[str]) -> bool:
    """Once the kernel has handled what the page sent, has the cell's figure changed?"""
    page.evaluate(KERNEL_DONE_JS, CELL_TIMEOUT_S * 1000)
    # The control's message can reach the kernel after the probe above (a slider sends on
    # release): then the kernel's redraw is still to come. On a loaded 2-core machine it
    # took more than 10 s (notebook 02's block map, once in a CI run) and more than 60 s
    # (notebook 03's explorer serving 7 requests twice, once in a CI run); waiting costs
    # nothing where the figure changes sooner.
    return _wait_for_change(cell, before, REDRAW_TIMEOUT_S)


def _check_app(page, cell, errors: list[str]) -> str:
    """Move the app's first control and see its figure redraw (pressing Run first where
    the app has one: the dashboard recomputes on Run, not on a move)."""
    cell.scroll_into_view_if_needed()
    before = cell.evaluate(FIGURES_JS)
    moved = _move_first_control(page, cell)
    buttons = cell.locator("button.jupyter-button", has_text="Run")
    if buttons.count():
        buttons.first.click()
        moved += ", Run"
    changed = _redrawn(page, cell, before)
    assert changed, (
        f"the plotly figure did not change in {REDRAW_TIMEOUT_S:.0f} s after the move "
        f"({moved}); its titles: {cell.evaluate(TITLES_JS)}; the page's last console "
        f"errors: {errors[-5:]}"
    )
    return moved


def _check_animation(page, cell) -> str:
    """Click a step on the plotly slider and see the figure show another frame."""
    before = cell.evaluate(FIGURES_JS)
    moved = _click_plotly_slider(page, cell)
    assert _wait_for_change(cell, before, 10), f"the animation did not move ({moved})"
    return moved


def check_in_browser(server: JupyterLab, tab: Tab, name: str, screenshot: Path, config) -> str:
    """Open `name`, Run All, check for errors, nbval's verdict on the outputs (`config`:
    pytest's) and drawn figures, move every app's first control and every animation's
    slider, see each figure redraw; take the screenshot."""
    started = time.monotonic()
    passed = False
    try:
        page = tab.open(name)
        prompts = _run_all(page)
        ran_s = time.monotonic() - started
        shown = page.locator(".jp-OutputArea-output", has_text="Traceback (most recent call last)")
        assert shown.count() == 0, f"a cell shows a traceback: {shown.first.inner_text()[:800]}"
        nb = _save(page, server, name)
        errors = _errors(nb)
        assert not errors, "cells raised errors:\n" + "\n".join(errors)
        assert all(p.strip("[]: ").isdigit() for p in prompts), f"cells not run: {prompts}"
        committed = nbformat.read(NOTEBOOKS / name, as_version=4)
        differences = output_differences(nb, committed, config)
        assert not differences, "nbval: " + "\n\n".join(differences)
        figures = _check_figures_drawn(page, nb)
        assert figures, "the notebook draws no plotly figure"

        cells = page.locator(f"{PANEL} .jp-Cell")
        apps = [cells.nth(i) for i, cell in enumerate(nb.cells) if _outputs(cell, WIDGET_MIME)]
        moves = [_check_app(page, cell, tab.errors) for cell in apps]
        animated = cells.filter(has=page.locator(".js-plotly-plot .slider-container"))
        moves += [_check_animation(page, animated.nth(i)) for i in range(animated.count())]

        page.mouse.move(0, 0)  # no hover labels or plotly toolbar in the picture
        time.sleep(1.0)  # let plotly finish drawing before the picture
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        if apps:  # the first app's output area: the app, not its code
            apps[0].locator(".jp-OutputArea").first.screenshot(path=screenshot)
        else:  # the animation that was stepped, or else the first figure
            figures_shown = page.locator(f"{PANEL} .jp-OutputArea .js-plotly-plot")
            animations = figures_shown.filter(has=page.locator(".slider-container"))
            (animations if animations.count() else figures_shown).first.screenshot(path=screenshot)
        total_s = time.monotonic() - started
        passed = True
        return (
            f"{name}: Run All {ran_s:.0f} s, {figures} figures drawn, {len(apps)} apps, "
            f"moved: {'; '.join(moves) or 'nothing to move'}; {total_s:.0f} s in all"
        )
    except PlaywrightError as error:
        if tab.page is not None:
            tab.page.screenshot(path=server.root / f"failure-{Path(name).stem}.png")
        raise AssertionError(f"{error}\nserver log:\n{server.server_log()}") from None
    finally:
        tab.close(passed)
        server.shut_down_kernels()


@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs_and_its_widgets_redraw_in_a_real_browser(lab, name, pytestconfig):
    server, tab = lab
    screenshot = SCREENSHOTS / SCREENSHOT_NAMES.get(name, f"{Path(name).stem}.png")
    print(check_in_browser(server, tab, name, screenshot, pytestconfig))
