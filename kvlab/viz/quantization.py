"""Notebook 04's figures: K/V value and error histograms, outlier key channels, and the
quality-vs-bytes frontier of the KV codecs. Histograms are binned here, so a figure holds
bin counts, not hundreds of thousands of raw values."""

from __future__ import annotations

import ipywidgets as widgets
import pandas as pd
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from kvlab.cache.codecs import CODECS
from kvlab.experiments.quality import roundtrip
from kvlab.units import MiB
from kvlab.viz.app import App


def histogram(x: torch.Tensor, bins: int = 80) -> tuple[list[float], list[float]]:
    """Bin centres and counts of all values of x (a flat float histogram)."""
    x = x.detach().float().reshape(-1)
    lo, hi = float(x.min()), float(x.max())
    if lo == hi:
        lo, hi = lo - 0.5, hi + 0.5
    counts, edges = torch.histogram(x, bins=bins, range=(lo, hi))
    return ((edges[:-1] + edges[1:]) / 2).tolist(), counts.tolist()


class CodecExplorer(App):
    """Pick a codec and a layer: histograms of that layer's real K and V values, and of the
    codec's error on them (written through a KVPool with that codec and read back).

    k, v: (layers, tokens, kv_heads, head_dim), e.g. quality.teacher_forced(...).k.
    """

    PANELS = ("K values", "V values", "K error (decoded - true)", "V error (decoded - true)")

    def __init__(self, k: torch.Tensor, v: torch.Tensor, codec: str = "int8", layer: int = 0):
        self.k, self.v = k, v
        self.codec = widgets.Dropdown(options=list(CODECS), value=codec, description="kv_codec")
        self.layer = widgets.IntSlider(
            value=layer, min=0, max=k.shape[0] - 1, description="layer", continuous_update=False
        )
        figure = make_subplots(
            rows=2,
            cols=2,
            subplot_titles=self.PANELS,
            vertical_spacing=0.2,  # room for the top row's x title under its ticks
            horizontal_spacing=0.1,
        )
        for i in range(4):
            figure.add_trace(go.Bar(name=self.PANELS[i], showlegend=False), i // 2 + 1, i % 2 + 1)
        figure.update_yaxes(type="log")
        figure.update_yaxes(title_text="count", col=1)  # the right column shares it
        figure.update_xaxes(title_text="value", row=1)
        figure.update_xaxes(title_text="decoded - true", row=2)
        figure.update_layout(height=600, width=900, bargap=0, title="K/V values and codec error")
        self.figure = go.FigureWidget(figure)
        self.summary = widgets.HTML()
        for control in (self.codec, self.layer):
            control.observe(lambda _change: self.refresh(), names="value")
        self.refresh()

    def errors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """decoded - true for K and V of the selected layer and codec."""
        layer = self.layer.value
        k, v = self.k[layer : layer + 1], self.v[layer : layer + 1]
        k_hat, v_hat = roundtrip(self.codec.value, k, v)
        return k_hat - k, v_hat - v

    def refresh(self) -> None:
        layer = self.layer.value
        k_err, v_err = self.errors()
        panels = (self.k[layer], self.v[layer], k_err, v_err)
        with self.figure.batch_update():
            for trace, values in zip(self.figure.data, panels):
                trace.x, trace.y = histogram(values)
        self.summary.value = (
            f"<b>{self.codec.value}</b>, layer {layer}: max |K err| {k_err.abs().max():.3g}, "
            f"mean {k_err.abs().mean():.3g}; max |V err| {v_err.abs().max():.3g}, "
            f"mean {v_err.abs().mean():.3g}"
        )

    def view(self) -> widgets.Widget:
        return widgets.VBox([widgets.HBox([self.codec, self.layer]), self.summary, self.figure])


def layer_histograms(k: torch.Tensor, v: torch.Tensor, bins: int = 60) -> go.Figure:
    """Heatmaps of log10(count) of K and of V values, one row per layer."""
    figure = make_subplots(rows=1, cols=2, subplot_titles=("K values", "V values"))
    for col, x in enumerate((k, v), start=1):
        limit = float(x.abs().max())
        rows = [
            torch.histogram(x[layer].float().reshape(-1), bins=bins, range=(-limit, limit))[0]
            for layer in range(x.shape[0])
        ]
        z = torch.stack(rows).clamp(min=1).log10()
        centres = torch.linspace(-limit, limit, bins + 1)
        centres = ((centres[:-1] + centres[1:]) / 2).tolist()
        figure.add_trace(
            go.Heatmap(z=z.tolist(), x=centres, coloraxis="coloraxis", name=f"{'KV'[col - 1]}"),
            1,
            col,
        )
    figure.update_yaxes(title_text="layer", col=1)
    figure.update_xaxes(title_text="value")
    figure.update_layout(
        height=420, title="Distribution of K and V per layer", coloraxis_colorbar_title="log10 n"
    )
    return figure


def channel_magnitude(k: torch.Tensor, v: torch.Tensor, layer: int) -> pd.DataFrame:
    """Mean |value| of each channel (kv_head * head_dim + dim) of K and V at one layer."""
    heads, dim = k.shape[2], k.shape[3]
    return pd.DataFrame(
        {
            "channel": range(heads * dim),
            "head": [c // dim for c in range(heads * dim)],
            "k_mean_abs": k[layer].abs().mean(0).reshape(-1).tolist(),
            "v_mean_abs": v[layer].abs().mean(0).reshape(-1).tolist(),
        }
    )


def channel_magnitude_figure(k: torch.Tensor, v: torch.Tensor, layer: int) -> go.Figure:
    """Mean |K| and |V| per channel at one layer: a few key channels tower over the rest."""
    frame = channel_magnitude(k, v, layer)
    figure = go.Figure(
        [
            go.Bar(x=frame["channel"], y=frame["k_mean_abs"], name="K"),
            go.Bar(x=frame["channel"], y=frame["v_mean_abs"], name="V"),
        ]
    )
    dim = k.shape[3]
    for head in range(1, k.shape[2]):
        figure.add_vline(x=head * dim - 0.5, line_dash="dot", line_color="grey")
    figure.update_layout(
        title=f"Mean |value| per channel, layer {layer} (dotted lines: kv-head boundaries)",
        xaxis_title="channel (kv_head x head_dim + dim)",
        yaxis_title="mean |value| over tokens",
        barmode="overlay",
        height=380,
    )
    return figure


def codec_frontier_figure(report: pd.DataFrame) -> go.Figure:
    """Bytes per token against perplexity increase and greedy agreement, one point per codec.

    With a codec_report's sample columns, the perplexity points carry their 95% interval
    as error bars and the panel titles say how many tokens and steps each score rests on.
    """
    titles = ["perplexity increase vs baseline", "greedy-token agreement"]
    if "tokens_scored" in report:
        titles[0] += f" (95% interval, {int(report['tokens_scored'].iloc[0]):,} tokens)"
    if "steps_compared" in report:
        titles[1] += f" ({int(report['steps_compared'].iloc[0]):,} steps)"
    figure = make_subplots(rows=1, cols=2, subplot_titles=titles)
    for col, column in enumerate(("ppl_increase_pct", "greedy_agreement"), start=1):
        error = None
        if column == "ppl_increase_pct" and {"ppl_pct_low", "ppl_pct_high"} <= set(report):
            error = dict(
                type="data",
                array=report["ppl_pct_high"] - report[column],
                arrayminus=report[column] - report["ppl_pct_low"],
            )
        figure.add_trace(
            go.Scatter(
                x=report["bytes_per_token"],
                y=report[column] * (100 if column == "greedy_agreement" else 1),
                error_y=error,
                text=report["codec"],
                mode="markers+text",
                textposition="top center",
                showlegend=False,
            ),
            1,
            col,
        )
    figure.update_xaxes(type="log", title_text="bytes per token (log)")
    figure.update_yaxes(title_text="%", col=1)
    figure.update_yaxes(title_text="% of tokens equal", col=2)
    figure.update_layout(height=400, title="Quality vs bytes: the codec frontier")
    return figure


def capacity_figure(report: pd.DataFrame, budget_bytes: int | None = None) -> go.Figure:
    """Requests held at once at one budget, per codec."""
    title = "Doc-QA requests the cache admits at once"
    if budget_bytes:
        title += f" ({budget_bytes / MiB:.0f} MiB of KV)"
    figure = go.Figure(
        go.Bar(
            x=report["codec"],
            y=report["capacity"],
            text=[
                f"{c} ({b} B/token)" for c, b in zip(report["capacity"], report["bytes_per_token"])
            ],
            textposition="outside",
        )
    )
    figure.update_layout(title=title, yaxis_title="concurrent requests", height=380)
    return figure
