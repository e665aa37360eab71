"""What an engine runs on: its parts, built once and passed in.

`kvlab.build` builds them from an `EngineConfig` (the runner, local or tensor-parallel;
the attention chain; the cache with its allocator, prefix index and tier connector; the
speculator); `EngineCore` only runs them. A test or a lab may hand the core parts of its
own. The engine never imports the packages that make the optional parts (speculation,
tensor parallel): it talks to them through the interfaces below.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from kvlab.cache.base import KVCache
from kvlab.config import DEFAULT_MAX_MODEL_LEN, EngineConfig
from kvlab.model.runner import ModelRunner
from kvlab.sequence import Sequence


class Speculation(Protocol):
    """What a step asks of speculative decoding (kvlab.speculative.Speculator)."""

    stats: object  # SpecStats: drafted, accepted, ... (`Engine.spec_stats()`)

    def plan(self, running: list[Sequence]) -> None:
        """Before scheduling: each decoding sequence's room for drafts."""

    def leave_out(self, batch, running: list[Sequence]) -> None:
        """Running sequences the step leaves out drop their drafts."""

    def draft(self, batch) -> None:
        """Fill the batch's decode rows with drafts (before the forward)."""

    def verify(self, seq: Sequence, logits: torch.Tensor) -> list[int]:
        """The tokens a row carrying drafts emits."""

    def count_decode(self, emitted: int) -> None:
        """A decode row emitted `emitted` tokens."""

    def rollback(self, seq: Sequence) -> None:
        """After the emitted tokens are appended: return the rejected drafts' slots."""


@dataclass
class EngineParts:
    """The parts of one engine, each made once (see the module docstring)."""

    runner: ModelRunner  # the model's forward, its attention chain set up
    cache: KVCache  # with its allocator, prefix index and tier connector
    max_model_len: int  # longest sequence, prompt + output
    speculator: Speculation | None = None  # speculative decoding, if configured
    parallel: object | None = None  # tensor parallel: the ranks' handle (its processes)
    close: Callable[[], None] = lambda: None  # stops worker processes (tensor parallel)


def max_model_len_of(model_config, config: EngineConfig) -> int:
    """The longest sequence an engine serves: `config.max_model_len`, or the model's
    max_position_embeddings capped at DEFAULT_MAX_MODEL_LEN; ValueError past the model's."""
    limit = model_config.max_position_embeddings
    if model_config.model_type == "mistral" and getattr(model_config, "sliding_window", None):
        limit = min(limit, model_config.sliding_window)  # kvlab attends to the full context
    wanted = config.max_model_len or min(limit, DEFAULT_MAX_MODEL_LEN)
    if wanted > limit:
        raise ValueError(f"EngineConfig.max_model_len={wanted} exceeds the model's {limit}")
    return wanted
