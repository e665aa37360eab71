"""Notebook 08's capacity planner app: pick a model, an accelerator and dtypes; see what fits.

Every change recomputes `kvlab.planner.plan` (arithmetic only, instant) and redraws two
panels: max concurrent sequences against context length (paged, naive, and the same
model with MHA), and the memory `users` sequences at the chosen context need, against
what the accelerator offers.
"""

from __future__ import annotations

import html

import ipywidgets as widgets
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvlab.planner import (
    MODELS,
    WEIGHT_DTYPES,
    ModelShape,
    capacity_curve,
    kv_formats,
    plan,
)
from kvlab.units import GiB
from kvlab.viz.app import App, round_slider

# Accelerator memory the slider offers, GiB: small devices, then real ones (T4 16, A10/L4 24,
# V100/RTX 5090 32, A100 40/80, L40S 48, RTX PRO 6000 96, H200 141, MI300X/B200 192,
# MI355X/B300 288) and multi-device totals. A `memory_gib` not listed is added in order.
MEMORY_GIB = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 64, 80, 96, 128, 141, 192, 256, 288, 512,
              1024)  # fmt: skip
CONTEXTS = tuple(2**k for k in range(7, 18))  # 128 .. 131072 tokens
BLOCK_SIZES = (1, 8, 16, 32, 64, 128, 256)
PANELS = ("max concurrent sequences", "memory for the users at this context")
COLORS = {"paged": "#636efa", "naive": "#ef553b", "paged_mha": "#00cc96"}


class PlannerApp(App):
    """Widgets for model, memory, dtypes, context, block size and users; two live panels."""

    def __init__(
        self,
        model: str = "Llama-3-8B",
        memory_gib: float = 80.0,
        weight_dtype: str = "bf16",
        kv_codec: str = "auto",
        context_len: int = 4096,
        block_size: int = 16,
        users: int = 32,
    ):
        style = {"description_width": "110px"}
        self.model = widgets.Dropdown(
            options=list(MODELS), value=model, description="model", style=style
        )
        self.memory = round_slider(MEMORY_GIB, memory_gib, description="memory GiB", style=style)
        self.weight_dtype = widgets.Dropdown(
            options=list(WEIGHT_DTYPES), value=weight_dtype, description="weights", style=style
        )
        self.kv_codec = widgets.Dropdown(
            options=["auto", *kv_formats()], value=kv_codec, description="KV codec", style=style
        )
        self.context = widgets.SelectionSlider(
            options=list(CONTEXTS), value=context_len, description="context", style=style
        )
        self.block_size = widgets.Dropdown(
            options=list(BLOCK_SIZES), value=block_size, description="block size", style=style
        )
        self.users = widgets.IntSlider(
            value=users, min=1, max=512, description="users", style=style
        )
        self.summary = widgets.HTML()
        # Wide panels with a wide gap: the titles, the right panel's y title and the left
        # panel's log ticks would otherwise run into each other.
        self.figure = go.FigureWidget(
            make_subplots(rows=1, cols=2, subplot_titles=PANELS, horizontal_spacing=0.14)
        )
        for name, label in (
            ("paged", "paged"),
            ("naive", "naive (max_model_len)"),
            ("paged_mha", "paged, same model with MHA"),
        ):
            self.figure.add_scatter(
                name=label, mode="lines+markers", line=dict(color=COLORS[name]), row=1, col=1
            )
        for label, color in (("weights", "#7f7f7f"), ("activations", "#bcbd22"), ("KV", "#636efa")):
            self.figure.add_bar(name=label, marker_color=color, row=1, col=2)
        self.figure.add_scatter(
            name="usable memory", mode="lines", line=dict(color="black", dash="dash"), row=1, col=2
        )
        self.figure.update_xaxes(type="log", title_text="context length (tokens)", row=1, col=1)
        self.figure.update_yaxes(type="log", title_text="sequences", row=1, col=1)
        self.figure.update_yaxes(title_text="GiB", row=1, col=2)
        self.figure.update_layout(height=440, width=1000, barmode="stack")
        self.plan = None
        for control in self.controls():
            control.observe(lambda _change: self.refresh(), names="value")
        self.refresh()

    def controls(self) -> list[widgets.Widget]:
        return [
            self.model,
            self.memory,
            self.weight_dtype,
            self.kv_codec,
            self.context,
            self.block_size,
            self.users,
        ]

    def options(self) -> dict:
        """`plan` keyword arguments from the widgets (all but context and users)."""
        return dict(
            memory=int(self.memory.value * GiB),
            weight_dtype=self.weight_dtype.value,
            kv_codec=None if self.kv_codec.value == "auto" else self.kv_codec.value,
            block_size=self.block_size.value,
        )

    def refresh(self) -> None:
        """Recompute the plan and redraw both panels."""
        shape = ModelShape.from_config(self.model.value)
        context, users = self.context.value, self.users.value
        if context > shape.max_position_embeddings:
            self.summary.value = (
                f"<b>{context:,} tokens exceed {shape.name}'s context window of "
                f"{shape.max_position_embeddings:,}</b>: pick a shorter context"
            )
            return
        options = self.options()
        self.plan = p = plan(shape, context_len=context, users=users, **options)
        mha = plan(shape.with_mha(), context_len=context, users=users, **options)
        curve = capacity_curve(shape, **options)
        with self.figure.batch_update():
            for trace, column in zip(self.figure.data[:3], ("paged", "naive", "paged_mha")):
                trace.x = curve["context_len"].tolist()
                trace.y = [max(v, 0.5) for v in curve[column]]  # 0 drawn at the log axis floor
            labels = [f"GQA ({p.num_blocks:,} blocks)", "MHA"]
            kv = [p.users_kv_bytes, mha.users_kv_bytes]
            for trace, values in zip(
                self.figure.data[3:6],
                (
                    [p.weight_bytes, mha.weight_bytes],
                    [p.activation_bytes, mha.activation_bytes],
                    kv,
                ),
            ):
                trace.x, trace.y = labels, [v / GiB for v in values]
            usable = p.memory_bytes * p.utilization / GiB
            self.figure.data[6].x, self.figure.data[6].y = labels, [usable, usable]
            self.figure.layout.title = f"{shape.name}: {users} users x {context:,} tokens " + (
                "fit" if p.users_fit else "do NOT fit"
            )
        self.summary.value = f"<pre>{html.escape(p.summary())}</pre>"

    def view(self) -> widgets.Widget:
        controls = self.controls()
        return widgets.VBox(
            [
                widgets.HBox([widgets.VBox(controls[:4]), widgets.VBox(controls[4:])]),
                self.figure,
                self.summary,
            ]
        )
