"""What every widget app in kvlab.viz shares: a notebook shows the app by showing its widget,
and a slider over round values (`round_slider`) for sizes a person would pick."""

from __future__ import annotations

import ipywidgets as widgets
import plotly.graph_objects as go


class App:
    """A widget app: its `widget()` (by default its `control` above its `figure`) is what a
    notebook displays when the app object is the cell's value."""

    control: widgets.Widget
    figure: go.FigureWidget

    def widget(self) -> widgets.Widget:
        return widgets.VBox([self.control, self.figure])

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget())


def round_slider(
    values: tuple[float, ...], value: float, description: str, **kwargs
) -> widgets.SelectionSlider:
    """A slider that offers only `values` (round sizes: 16, 24, 32 ...) and `value`, added in
    order if it is not one of them, so each step lands on a number a person would type
    (a log slider's steps land on 2**4.5 = 22.6). Its `.value` is the number, its readout
    the number as `:g` writes it."""
    options = sorted({*values, value})
    return widgets.SelectionSlider(
        options=[(f"{v:g}", v) for v in options], value=value, description=description, **kwargs
    )
