"""What every widget app in kvlab.viz shares: a notebook shows the app by showing its widget."""

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
