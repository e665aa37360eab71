"""Notebook 01's widget: per-token latency with and without a KV cache, re-measured live."""

from __future__ import annotations

import ipywidgets as widgets
import plotly.graph_objects as go

from kvlab.experiments.why_cache import compare_decoding
from kvlab.model.runner import ModelRunner
from kvlab.viz.app import App

MODES = ("no cache", "KV cache")


class CacheLatencyExplorer(App):
    """A slider for the prompt length and one for new tokens; moving either re-runs both
    decoders on the real model and redraws latency per token against position."""

    def __init__(
        self, runner: ModelRunner, text_ids: list[int], prompt_len: int = 64, new_tokens: int = 48
    ):
        self.runner, self.text_ids = runner, text_ids
        self.prompt_len = widgets.IntSlider(
            value=prompt_len,
            min=8,
            max=min(512, len(text_ids)),
            step=8,
            description="prompt tokens",
            continuous_update=False,
            style={"description_width": "initial"},  # the whole label, not "prompt to..."
        )
        self.new_tokens = widgets.IntSlider(
            value=new_tokens,
            min=8,
            max=128,
            step=8,
            description="new tokens",
            continuous_update=False,
            style={"description_width": "initial"},
        )
        self.figure = go.FigureWidget(
            data=[go.Scatter(name=mode, mode="lines+markers") for mode in MODES],
            layout=go.Layout(
                title="Time per generated token vs its position",
                xaxis_title="position of the generated token",
                yaxis_title="latency (ms)",
                height=380,
            ),
        )
        for slider in (self.prompt_len, self.new_tokens):
            slider.observe(lambda _change: self.refresh(), names="value")
        self.refresh()

    def refresh(self) -> None:
        """Measure both decoders at the current slider values and redraw."""
        prompt = self.text_ids[: self.prompt_len.value]
        self.frame = compare_decoding(self.runner, prompt, self.new_tokens.value)
        with self.figure.batch_update():
            for trace, mode in zip(self.figure.data, MODES):
                rows = self.frame[self.frame["mode"] == mode]
                trace.x = rows["position"].tolist()
                trace.y = (rows["latency_s"] * 1e3).tolist()

    def view(self) -> widgets.Widget:
        return widgets.VBox([widgets.HBox([self.prompt_len, self.new_tokens]), self.figure])
