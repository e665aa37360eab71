"""Config names: "paged+prefix+int8" spells an EngineConfig, for `kvlab compare`/`bench`.

A name is a cache kind followed by "+"-separated options: a prefix index ("hash", "radix",
or "prefix" for hash, as vLLM), a KV codec ("int8", "kivi2", ...), "chunked" (chunked
prefill), "watermark" (watermark admission, with preemption: the paged default, spelled
out), "reserve" (reserve admission: worst case promised, never preempts), "swap" (swap
preemption), "static" (static batching), "kernels" (decode attention through
kvlab.kernels: Triton on CUDA, the native C kernel on the CPU), "invariant"
(batch-invariant mode: EngineConfig.batch_invariant) and "bsN" (block size N).
Cache kinds, prefix indexes and codecs come from their registries, so a newly registered
one is a valid option at once.

The budget helpers turn "64MiB", "200MB", a byte count or "4096tok" into bytes.
"""

from __future__ import annotations

import re
from dataclasses import fields

from kvlab.cache import CACHES, PREFIX_INDEXES, check_config
from kvlab.cache.codecs import CODECS
from kvlab.config import EngineConfig
from kvlab.model.loading import LoadedModel
from kvlab.units import parse_size, round_up
from kvlab.workloads import Request

DEFAULT_CONFIGS = ("naive", "paged", "paged+prefix", "paged+prefix+int8")
# "+option" -> EngineConfig fields it sets (besides prefix indexes and codecs).
FLAGS: dict[str, dict[str, object]] = {
    "prefix": {"prefix_caching": "hash"},
    "chunked": {"chunked_prefill": True},
    "watermark": {"admission": "watermark"},
    "reserve": {"admission": "reserve"},
    "swap": {"preemption": "swap"},
    "static": {"batching": "static"},
    "kernels": {"attention": "kernels"},
    "invariant": {"batch_invariant": True},
}


def options() -> dict[str, dict[str, object]]:
    """Every "+option" a config name may use, and the EngineConfig fields it sets."""
    return (
        FLAGS
        | {name: {"prefix_caching": name} for name in PREFIX_INDEXES.names()}
        | {name: {"kv_codec": name} for name in CODECS.names()}
    )


def parse_config(name: str, **base) -> EngineConfig:
    """The EngineConfig a config name spells ("paged+prefix+int8"), on top of `base` fields.

    Raises ValueError naming the unknown part and the parts that are known, or the
    parts that do not combine (kvlab.cache.check_config: "naive+prefix"), so a bad name
    fails before any model loads.
    """
    cache, *parts = name.strip().split("+")
    if cache not in CACHES:
        raise ValueError(f"config {name!r} must start with a cache kind, one of {CACHES.names()}")
    known, table = {f.name for f in fields(EngineConfig)}, options()
    chosen: dict[str, object] = {"cache": cache}
    for part in parts:
        block = re.fullmatch(r"bs(\d+)", part)
        if block:
            chosen["block_size"] = int(block.group(1))
        elif part in table:
            missing = set(table[part]) - known
            if missing:
                raise ValueError(f"config {name!r}: this kvlab's EngineConfig has no {missing}")
            chosen.update(table[part])
        else:
            raise ValueError(
                f"config {name!r}: unknown option {part!r}; options are {sorted(table)} "
                "and bsN (block size N)"
            )
    config = EngineConfig(**{**base, **chosen})
    check_config(config)
    return config


def model_bytes_per_token(model: LoadedModel) -> int:
    """KV bytes per token of the model in its own dtype (kv_codec None)."""
    from kvlab.model.runner import kv_spec_of

    return CODECS[None].token_bytes(kv_spec_of(model.config), model.dtype)


def default_max_model_len(model: LoadedModel, requests: list[Request]) -> int:
    """The longest request (token-id prompt + max_new_tokens), rounded up to 256."""
    longest = max(len(r.prompt) + r.max_new_tokens for r in requests)
    return min(round_up(longest, 256), model.config.max_position_embeddings)


def parse_budget(text: str | int, bytes_per_token: int) -> int:
    """A KV budget in bytes from "64MiB", "200MB", a byte count, or "4096tok" (tokens at
    `bytes_per_token`, the model's own dtype)."""
    if isinstance(text, str):
        tokens = re.fullmatch(r"\s*(\d+)\s*(tok|tokens)\s*", text)
        if tokens:
            return int(tokens.group(1)) * bytes_per_token
    return parse_size(text)
