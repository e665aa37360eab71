"""The proposer interface: who drafts the tokens a step verifies."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from kvlab.cache.base import KVCache
    from kvlab.config import SpeculativeConfig
    from kvlab.model.runner import ModelRunner
    from kvlab.sequence import Sequence


class Proposer(ABC):
    """Drafts up to `room` tokens to follow each decoding sequence's tokens.

    `drafts_in_slots` says when it runs. False: before the step is scheduled, from the
    tokens alone (the scheduler then reserves exactly 1 + len(drafts) slots). True: after
    the scheduler has secured 1 + room slots for the sequence, because drafting writes K/V
    into those slots (the verify forward overwrites them).
    """

    name: ClassVar[str]  # set by PROPOSERS.register
    drafts_in_slots: ClassVar[bool] = False

    def __init__(self, config: SpeculativeConfig, runner: ModelRunner, cache: KVCache):
        self.config, self.runner, self.cache = config, runner, cache

    @abstractmethod
    def propose(self, seqs: list[Sequence], room: list[int]) -> list[list[int]]:
        """At most room[i] draft token ids to follow seqs[i].token_ids (may be fewer)."""

    def describe(self) -> str:
        """One line for tables and plots."""
        return self.name
