"""The capacity planner: KV bytes per token, weights and the sequences a memory holds.

`shape.py` reads a model's shape; `plan.py` does the arithmetic. Its live check against the
engine is `kvlab.experiments.capacity_check`.
"""

from kvlab.planner.plan import (
    Plan,
    capacity_curve,
    gqa_vs_mha,
    plan,
    predict_engine_capacity,
    rank_shape,
)
from kvlab.planner.shape import (
    FLOAT_DTYPES,
    MODELS,
    WEIGHT_DTYPES,
    ModelShape,
    activation_bytes,
    kv_bytes_per_token,
    kv_formats,
    weight_bytes,
)
from kvlab.units import parse_size

__all__ = [
    "FLOAT_DTYPES",
    "MODELS",
    "WEIGHT_DTYPES",
    "ModelShape",
    "Plan",
    "activation_bytes",
    "capacity_curve",
    "gqa_vs_mha",
    "kv_bytes_per_token",
    "kv_formats",
    "parse_size",
    "plan",
    "predict_engine_capacity",
    "rank_shape",
    "weight_bytes",
]
