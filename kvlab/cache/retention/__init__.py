"""KV retention policies for the paged cache: which blocks of a long sequence stay.

Registered parts (`RETENTION`), named by `EngineConfig.retention`: "full" (everything,
the default), "window" (a sliding window of recent tokens), "sinks" (StreamingLLM: the
first tokens plus the window) and "h2o" (heavy hitters by accumulated attention plus the
window). See base.py for how dropped blocks, positions and prefix sharing work.
"""

from __future__ import annotations

# isort: off
from kvlab.cache.retention.base import DROPPED, RetentionPolicy, leading_kept
from kvlab.cache.retention.registry import RETENTION
from kvlab.cache.retention.full import FullRetention  # registers "full"
from kvlab.cache.retention.h2o import HeavyHitterRetention  # registers "h2o"
from kvlab.cache.retention.sinks import SinksRetention  # registers "sinks"
from kvlab.cache.retention.window import WindowRetention  # registers "window"
# isort: on

__all__ = [
    "DROPPED",
    "RETENTION",
    "FullRetention",
    "HeavyHitterRetention",
    "RetentionPolicy",
    "SinksRetention",
    "WindowRetention",
    "leading_kept",
]
