"""Widget apps and plotly figures used by the notebooks."""
