"""What every widget app in kvlab.viz shares: a notebook shows the app by showing its widget,
and a slider over round values (`round_slider`) for sizes a person would pick."""

from __future__ import annotations

from collections.abc import Iterator
from copy import deepcopy

import ipywidgets as widgets
import plotly.graph_objects as go


class App:
    """A widget app: its `widget()` (its `view()`: by default its `control` above its
    `figure`) is what a notebook displays when the app object is the cell's value."""

    control: widgets.Widget
    figure: go.FigureWidget

    def view(self) -> widgets.Widget:
        """The app's controls and figures laid out as one widget."""
        return widgets.VBox([self.control, self.figure])

    def widget(self) -> widgets.Widget:
        """The app's `view()`, each of its figures carrying the state it has now."""
        tree = self.view()
        for figure in _figures(tree):
            current(figure)
        return tree

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget())


def current(figure: go.FigureWidget) -> go.FigureWidget:
    """`figure` with its widget state (what a front end draws first) set to the figure as it
    stands.

    A FigureWidget (an anywidget since plotly 6) tells its front end of each edit in a
    one-off message, which a front end still loading plotly's 5 MB script misses: an app's
    figure, filled in before it is shown, then opens blank (a CI run on a loaded 2-core
    machine drew notebook 02's block map with no title). Shown alone, the figure copies its
    state into its widget state first; inside a VBox it does not (plotly/plotly.py#4998),
    so this does the same copy."""
    figure._widget_layout = deepcopy(figure._layout_obj._props)
    figure._widget_data = deepcopy(figure._data)
    return figure


def _figures(widget: widgets.Widget) -> Iterator[go.FigureWidget]:
    """Every FigureWidget in a widget tree."""
    if isinstance(widget, go.FigureWidget):
        yield widget
    for child in getattr(widget, "children", ()):
        yield from _figures(child)


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
