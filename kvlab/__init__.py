"""kvlab: a workbench that shows, on a real model, how serving engines manage the KV cache.

The layout is the architecture:

    kvlab/engine/       requests in, tokens out: engine, scheduler, sequence, sampler, telemetry
    kvlab/model/        loading a Llama-family model, kvlab's own forward, attention, metadata
    kvlab/cache/        KV caches (naive, paged), block allocator, prefix indexes, codecs
    kvlab/experiments/  measured comparisons: compare, bench, stress, quality, sharing, ...
    kvlab/peers/        the systems kvlab is measured against: HF transformers, vLLM
    kvlab/checks/       kvlab checked against references: kernels, vLLM as an oracle
    kvlab/presets.py    config names ("paged+prefix+int8") and KV budgets ("64MiB")
    kvlab/cli/          the `kvlab` command line, a module per command
    kvlab/viz/          figures and widget apps for the notebooks
    kvlab/labs/         classroom exercises and their graders
    kvlab/planner/      the capacity planner
    kernels/            Triton kernels (installed as kvlab.kernels; needs only torch + triton)

The names below are imported on first use, so `import kvlab.kernels` (or any submodule)
loads nothing it does not need.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Engine": "kvlab.build",
    "EngineConfig": "kvlab.config",
    "SamplingParams": "kvlab.config",
    "LoadedModel": "kvlab.model.loading",
    "load_model": "kvlab.model.loading",
    "RequestMetrics": "kvlab.engine.outputs",
    "RequestOutput": "kvlab.engine.outputs",
}
__all__ = list(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    try:  # a submodule: kvlab.workloads, kvlab.texts, ...
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as error:
        if error.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module 'kvlab' has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
