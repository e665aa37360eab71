"""Notebook 04's exercises: what a codec's bytes per token include, what MLA's single
latent saves, and when a perplexity change is noise."""

from __future__ import annotations

import pandas as pd

from kvlab.cache.spec import KVSpec
from kvlab.course.exercise import exercise


def _smollm2() -> dict:
    """SmolLM2-135M's KV shape (30 layers, 3 KV heads of 64), for the tests."""
    return {"spec": KVSpec(num_layers=30, num_kv_heads=3, head_dim=64)}


def _int8_hint(answer, right) -> str:
    if answer == right - 2 * 30 * 3 * 2 or answer * 2 == right - 2 * 30 * 3 * 2:
        return (
            "you left out the scales: each token keeps one bf16 scale (2 bytes) per KV "
            "head, for K and for V, in every layer."
        )
    if answer * 2 == right:
        return "half of it: K and V are stored separately, each with its own scales."
    return "per layer, per KV head, for K and for V: head_dim int8 codes + one 2-byte scale."


@exercise(
    "04.int8-bytes",
    question="How many bytes does one token take in the int8 cache, scales included (one "
    "bf16 scale per token per KV head, for K and for V, in every layer)?",
    solution="2 (K, V) x 30 layers x 3 KV heads x (64 one-byte codes + a 2-byte scale) = "
    "11,880 bytes: a little over half of fp16's 23,040, not exactly half "
    "(`CODECS['int8'].token_bytes(spec, dtype)`).",
    hint=_int8_hint,
    example=_smollm2,
)
def int8_bytes(spec: KVSpec) -> int:
    import torch

    from kvlab.cache.codecs import CODECS

    return CODECS["int8"].token_bytes(spec, torch.float32)


def _mla_hint(answer, right) -> str:
    if answer == 2 * right:
        return (
            "twice it: MLA has no separate V. One latent per token per layer is all it "
            "stores (vLLM's page coefficient 1, not 2)."
        )
    if answer * 30 == right:
        return "that is one layer: every layer stores its own latent."
    if answer * 2 == right:
        return "bf16 takes 2 bytes per element."
    return "layers x latent elements x 2 bytes (bf16), with no factor 2 for K and V."


@exercise(
    "04.mla-bytes",
    question="MLA stores one latent vector per token per layer and no separate V. With "
    "this model's layers and a latent of `latent` elements (DeepSeek-V2's ratios: "
    "4 x head_dim + head_dim / 2), how many bytes per token in bf16?",
    solution="30 layers x 288 elements x 2 bytes = 17,280 bytes: 4x less than MHA's "
    "69,120 for this shape, but more than MQA's 7,680 (MLA keeps more per token than "
    "MQA and, per DeepSeek-V2, quality above MHA's).",
    hint=_mla_hint,
    example=lambda: {**_smollm2(), "latent": 288},
)
def mla_bytes(spec: KVSpec, latent: int) -> int:
    import torch

    from kvlab.experiments.quality import attention_layouts

    layouts = attention_layouts(spec, spec.num_kv_heads, torch.bfloat16, latent)  # MLA: any
    return int(layouts.set_index("attention").loc["MLA", "bytes_per_token"])


def _report_example() -> dict:
    """A report's perplexity columns: int8's interval holds 0, fp8_e5m2's does not."""
    report = pd.DataFrame(
        {
            "codec": ["baseline", "int8", "fp8_e5m2"],
            "ppl_increase_pct": [0.0, -0.07, 2.0],
            "ppl_pct_low": [0.0, -0.4, 1.2],
            "ppl_pct_high": [0.0, 0.3, 2.8],
        }
    )
    return {"report": report}


@exercise(
    "04.int8-noise",
    question="Read int8's row: perplexity change and its 95% interval (ppl_pct_low, "
    "ppl_pct_high). On this much text, does int8 make perplexity go 'up', 'down', or is "
    "the change 'noise'?",
    solution="Read the interval, not the sign: on the stored run (512 tokens) int8 moved "
    "perplexity by -0.07%, with a 95% interval of -0.39% to +0.25%. It holds 0, so the "
    "change is noise: this much text cannot tell int8 from the baseline (the old 128-token "
    "run's int8 'improvement' of 0.8% was noise too). fp8_e5m2, int4 and kivi2 are clearly "
    "up; fp16's tiny -0.017% is beyond noise yet negligible.",
    hint="look at int8's ppl_pct_low and ppl_pct_high: does the interval between them "
    "hold 0? If it does, this much text cannot tell the change from chance.",
    choices=("up", "down", "noise"),
    example=_report_example,
)
def int8_noise(report: pd.DataFrame) -> str:
    from kvlab.experiments.quality import beyond_noise

    verdicts = beyond_noise(report)
    return verdicts[report["codec"] == "int8"].iloc[0]
