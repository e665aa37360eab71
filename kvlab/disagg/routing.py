"""Which decode engine of a pool takes a prefilled request: the least-loaded one.

    least-loaded   the engine with the fewest unfinished requests (running, waiting, or
                   arrived and waiting to be loaded); a tie goes to the one with the most
                   free KV blocks, then to the first

It is the rule of vLLM's XpYd proxy demo (`LoadBalancedScheduler`: the decode instance
with the fewest requests in flight, the first on a tie) and of notebook 14's router
(`kvlab.route`, policy "least-loaded"), read here off each engine's own scheduler rather
than counted by a proxy. The policy sees plain numbers (`Load`), so it can be checked
without an engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvlab.build import Engine

POLICY = "least-loaded"


@dataclass(frozen=True)
class Load:
    """One decode engine's load, as the policy sees it."""

    requests: int  # unfinished: running, waiting, or arrived and not loaded yet (swapped)
    free_blocks: int  # KV blocks its cache can still hand out


def load_of(engine: Engine) -> Load:
    """An engine's load, read off its scheduler's queues and its cache."""
    s = engine.scheduler
    return Load(len(s.running) + len(s.waiting) + len(s.swapped), engine.cache.num_available)


def least_loaded(loads: Sequence[Load]) -> int:
    """The index of the engine that takes the next request: fewest requests, then most
    free blocks, then the first."""
    return min(range(len(loads)), key=lambda i: (loads[i].requests, -loads[i].free_blocks, i))
