"""kvlab: a workbench that shows, on a real model, how serving engines manage the KV cache."""

from kvlab.config import EngineConfig, SamplingParams
from kvlab.engine import Engine
from kvlab.model_loading import LoadedModel, load_model
from kvlab.outputs import RequestMetrics, RequestOutput

__all__ = [
    "Engine",
    "EngineConfig",
    "LoadedModel",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "load_model",
]
__version__ = "0.1.0"
