"""Notebook 07's dashboard: one workload through several engine designs, side by side.

Widgets pick the workload, its size, the KV budget and the configs; "Run" serves the
workload through every config live on the real model (`kvlab.experiments.compare`) and redraws
four panels: KV memory over time (reserved vs live), throughput, latency, and peak
concurrency. Given a saved `kvlab bench` run (`bench=`), the throughput panel draws its
systems in grey beside the live bars, its title naming that run's workload and machine:
they are another run's figures, not this one's.

An endpoint box takes the URL of any OpenAI-compatible server (`kvlab serve`, `vllm serve`,
a multi-GPU vLLM deployment): "Replay" sends the same workload's token ids there and draws,
below, the server's own /metrics as they moved (KV usage, running, waiting) and the
latencies the client saw (`kvlab.serve.replay`).
"""

from __future__ import annotations

import html
from pathlib import Path

import ipywidgets as widgets
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvlab.experiments.bench import BenchResult
from kvlab.experiments.compare import Comparison, compare
from kvlab.model.loading import LoadedModel
from kvlab.presets import DEFAULT_CONFIGS
from kvlab.units import MiB
from kvlab.viz.app import App, round_slider
from kvlab.viz.compare import add_capacity, add_latency, add_memory, add_throughput
from kvlab.workloads import WORKLOADS, load_workload

CONFIG_CHOICES = (
    "naive",
    "naive+int8",
    "paged",
    "paged+prefix",
    "paged+radix",
    "paged+int8",
    "paged+prefix+int8",
    "paged+prefix+int4",
    "paged+prefix+kivi2",
)
# Per-workload options: answers short enough for a CPU run of a few requests to take
# seconds, not minutes. The constructor's `workload_options` update these.
WORKLOAD_OPTIONS = {
    "doc-qa": {"short_answer": (8, 16), "long_answer": (24, 32)},
    "chat": {"max_new_tokens": (8, 24)},
    "uniform-chat": {"max_new_tokens": 16},
}
# The KV budgets the slider offers, MiB (any other budget given is added in order).
BUDGETS_MIB = (4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536,
               2048, 3072, 4096)  # fmt: skip
PANELS = (
    "KV memory: reserved vs live (dotted)",
    "throughput, output tok/s",
    "latency",
    "peak concurrent sequences",
)


class Dashboard(App):
    """Workload, size, budget and configs in; memory, throughput and latency out.

    Args:
        model: the loaded model every config serves.
        workload: a built-in workload name; `n` requests of it.
        workload_options: {workload name: options of its builder}, over WORKLOAD_OPTIONS
            (e.g. {"doc-qa": {"seed": 8}}).
        budget_mib: the KV budget of every config, in MiB.
        configs: the configs selected at first.
        bench: a saved bench (BenchResult or a path to its JSON): its systems are drawn
            in grey beside kvlab's live throughput, the panel's title naming its workload
            and machine (another run: compare like with like).
        initial: a Comparison to draw at once instead of running (keeps notebooks fast).
        max_model_len: per-sequence cap (what the naive cache reserves); default from
            the workload (`kvlab.experiments.compare.default_max_model_len`).
    """

    def __init__(
        self,
        model: LoadedModel,
        workload: str = "doc-qa",
        n: int = 6,
        budget_mib: float = 128.0,
        configs: tuple[str, ...] = DEFAULT_CONFIGS,
        bench: BenchResult | str | Path | None = None,
        initial: Comparison | None = None,
        max_model_len: int | None = None,
        workload_options: dict[str, dict] | None = None,
    ):
        self.model, self.max_model_len = model, max_model_len
        self.workload_options = {k: dict(v) for k, v in WORKLOAD_OPTIONS.items()}
        for name, options in (workload_options or {}).items():
            self.workload_options.setdefault(name, {}).update(options)
        if isinstance(bench, str | Path):
            bench = BenchResult.load(bench)
        self.bench = bench
        self.result: Comparison | None = None
        self.workload = widgets.Dropdown(
            options=list(WORKLOADS), value=workload, description="workload"
        )
        self.n = widgets.IntSlider(value=n, min=1, max=32, description="requests")
        self.budget = round_slider(BUDGETS_MIB, budget_mib, description="KV MiB")
        options = list(dict.fromkeys([*CONFIG_CHOICES, *configs]))
        self.configs = widgets.SelectMultiple(
            options=options, value=tuple(configs), description="configs", rows=6
        )
        self.run_button = widgets.Button(description="Run", button_style="primary")
        self.run_button.on_click(lambda _button: self.run())
        self.status = widgets.HTML()
        self.endpoint = widgets.Text(
            placeholder="http://127.0.0.1:8000 (an OpenAI-compatible server)",
            description="endpoint",
        )
        self.replay_button = widgets.Button(description="Replay at endpoint")
        self.replay_button.on_click(lambda _button: self.replay())
        self.endpoint_box = widgets.VBox()
        self.replayed: dict = {}  # endpoint URL -> ReplayResult, every replay so far
        self.figure = go.FigureWidget(
            make_subplots(
                rows=2,
                cols=2,
                subplot_titles=PANELS,
                horizontal_spacing=0.1,
                vertical_spacing=0.14,
            )
        )
        self.figure.update_layout(
            height=720, width=1000, barmode="group", legend=dict(font=dict(size=10))
        )
        if self.bench is not None:
            machine = self.bench.provenance.get("machine") or self.bench.meta.get("machine")
            where = f", {machine}" if machine else ""
            title = f"throughput (grey: saved bench, {self.bench.workload}{where})"
            self.figure.layout.annotations[1].text = title
        if initial is not None:
            self.draw(initial)

    def requests(self):
        """The requests the widgets describe."""
        options = self.workload_options.get(self.workload.value, {})
        return load_workload(self.workload.value, n=self.n.value, **options)

    def run(self) -> Comparison | None:
        """Serve the workload through every selected config and redraw; errors (a budget
        too small for one naive sequence, say) go to the status line."""
        if not self.configs.value:
            self.status.value = "<b>pick at least one config</b>"
            return None
        self.status.value = "running..."
        try:
            result = compare(
                self.model,
                self.requests(),
                list(self.configs.value),
                budget_bytes=int(self.budget.value * MiB),
                max_model_len=self.max_model_len,
                workload=f"{self.workload.value} x {self.n.value}",
            )
        except ValueError as error:
            self.status.value = f"<b>error:</b> {html.escape(str(error))}"
            return None
        self.draw(result)
        return result

    def draw(self, result: Comparison) -> None:
        """Redraw every panel from a Comparison."""
        self.result = result
        peers = self.bench.peer_rates(prefix="bench: ") if self.bench else None
        self.figure.data = ()
        with self.figure.batch_update():
            add_memory(self.figure, result, 1, 1)
            add_throughput(self.figure, result, peers, 1, 2)
            add_latency(self.figure, result, 2, 1)
            add_capacity(self.figure, result, 2, 2)
        peaks = ", ".join(f"{n} {r.metrics['peak_concurrent']}" for n, r in result.runs.items())
        bench = f"; grey bars: saved bench on {self.bench.workload}" if self.bench else ""
        self.status.value = html.escape(
            f"{result.workload}: KV budget {result.budget_bytes / MiB:.1f} MiB, "
            f"max_model_len {result.max_model_len}; peak concurrent: {peaks}{bench}"
        )

    def replay(self, endpoint: str | None = None):
        """Replay the workload the widgets describe against `endpoint` (default: the
        endpoint box) and draw its /metrics and latencies beside earlier replays. Errors
        (no server there, say) go to the status line. Returns the ReplayResult or None."""
        from kvlab.serve.replay import replay_workload
        from kvlab.viz.endpoint import endpoint_figure

        url = (endpoint or self.endpoint.value).strip()
        if not url:
            self.status.value = "<b>type the URL of an OpenAI-compatible server</b>"
            return None
        self.status.value = f"replaying at {html.escape(url)}..."
        try:
            result = replay_workload(url, self.model, self.requests(), poll_s=0.2)
        except Exception as error:  # a refused connection, a 4xx: tell, don't raise
            self.status.value = (
                f"<b>replay at {html.escape(url)} failed:</b> {html.escape(str(error))}"
            )
            return None
        self.replayed[url] = result
        self.endpoint_box.children = [go.FigureWidget(endpoint_figure(self.replayed))]
        row = result.summary()
        self.status.value = html.escape(
            f"{url}: {row['requests']} requests, {row['output_tokens']} output tokens in "
            f"{result.wall_s:.1f} s; prefix hit rate {row['prefix_hit_rate']}"
        )
        return result

    def view(self) -> widgets.Widget:
        controls = widgets.VBox([self.workload, self.n, self.budget, self.run_button])
        remote = widgets.HBox([self.endpoint, self.replay_button])
        top = widgets.HBox([controls, self.configs])
        return widgets.VBox([top, self.status, self.figure, remote, self.endpoint_box])
