"""KV retention policies for the paged cache: which blocks of a long sequence stay.

Registered parts (`RETENTION`), named by `EngineConfig.retention`: "full" (everything,
the default), "window" (a sliding window of recent tokens), "sinks" (StreamingLLM: the
first tokens plus the window) and "h2o" (heavy hitters by accumulated attention plus the
window). See base.py for how dropped blocks, positions and prefix sharing work.
"""

from __future__ import annotations

from kvlab.registry import Registry

RETENTION = Registry("retention policy", "retention")

from kvlab.cache.retention.base import DROPPED, RetentionPolicy, leading_kept  # noqa: E402
from kvlab.cache.retention.full import FullRetention  # noqa: E402  (registers "full")
from kvlab.cache.retention.h2o import HeavyHitterRetention  # noqa: E402  (registers "h2o")
from kvlab.cache.retention.sinks import SinksRetention  # noqa: E402  (registers "sinks")
from kvlab.cache.retention.window import WindowRetention  # noqa: E402  (registers "window")


def check_config(config) -> None:
    """Raise ValueError if `config`'s retention fields are unknown or do not combine."""
    RETENTION[config.retention]  # the registry's error names the field and the choices
    for name, low in (("retention_window", 1), ("retention_sinks", 0), ("retention_heavy", 0)):
        value = getattr(config, name)
        if not isinstance(value, int) or value < low:
            raise ValueError(f"EngineConfig.{name}={value!r} must be an int >= {low}")
    if config.retention == "full":
        return
    for name, off in (("speculative", None), ("tensor_parallel_size", 1), ("tiers", None)):
        if getattr(config, name, off) != off:
            raise ValueError(
                f"EngineConfig.retention={config.retention!r} needs {name}={off!r}: drafts, "
                "shards and tiers are not combined with dropped blocks yet"
            )
    needs = {"cache": "paged", "preemption": "recompute", "attention": "torch"}
    for name, wanted in needs.items():
        if getattr(config, name) != wanted:
            raise ValueError(
                f"EngineConfig.retention={config.retention!r} needs {name}={wanted!r} "
                f"(got {getattr(config, name)!r}): dropped blocks live only in paged block "
                "tables, swap copies whole sequences and the kernels read whole tables"
            )


__all__ = [
    "DROPPED",
    "RETENTION",
    "FullRetention",
    "HeavyHitterRetention",
    "RetentionPolicy",
    "SinksRetention",
    "WindowRetention",
    "check_config",
    "leading_kept",
]
