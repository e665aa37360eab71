"""A request as the engine tracks it: its tokens, its state and its timings."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from kvlab.config import SamplingParams


class RequestState(str, enum.Enum):
    """Where a request is: the one vocabulary of sequences, scheduler events and plots."""

    WAITING = "waiting"  # queued, holds no KV memory
    RUNNING = "running"  # admitted, its KV lives in the cache
    PREEMPTED = "preempted"  # its KV was dropped; it waits to be recomputed
    SWAPPED = "swapped"  # its KV sits in host memory; it waits to be swapped back in
    FINISHED = "finished"
    CANCELLED = "cancelled"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Note:
    """One thing the engine did to a request, and why (`engine.explain(request_id)`)."""

    kind: str  # "prefix" | "preemption"
    label: str  # a short reason, e.g. "partial block" or "needed blocks"
    text: str  # a sentence for people


@dataclass(eq=False)  # one request is one object: `seq in running` compares identities
class Sequence:
    """One request. `num_computed` counts the tokens whose K/V are stored in the cache."""

    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    arrival_s: float = 0.0
    salt: str | None = None  # tenant / cache namespace: different salts never share KV
    priority: int = 0
    output_ids: list[int] = field(default_factory=list)
    status: RequestState = RequestState.WAITING
    num_computed: int = 0
    prefix_hit_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    first_token_s: float | None = None
    finish_s: float | None = None
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    parent_id: int | None = None  # n > 1: the request this sample was forked from
    admit_order: int = 0  # admission counter: the most recently admitted is preempted first
    preemptions: int = 0
    preempted_at: float | None = None  # engine clock when last preempted, until resumed
    stall_s: float = 0.0  # total time spent preempted
    notes: list[Note] = field(default_factory=list)  # prefix misses, preemptions: why
    # Speculative decoding: tokens drafted for this step (never in token_ids until
    # verified), and the drafts the scheduler reserves slots for beyond the pending token.
    draft_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # engine clock per output token
    spec_room: int = 0
    session: str | None = None  # the conversation it belongs to (kvlab.engine.sessions)
    error: str | None = None  # finish_reason "error": what failed (kvlab.engine.isolation)

    def inherit(self, parent: Sequence) -> None:
        """Become a sample forked from `parent` (n > 1) once its prompt is in: take the
        request's own fields (`REQUEST_FIELDS`) and the prompt's progress."""
        for name in REQUEST_FIELDS:
            setattr(self, name, getattr(parent, name))
        self.parent_id = parent.request_id

    @property
    def token_ids(self) -> list[int]:
        """Prompt followed by the tokens generated so far."""
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        """Tokens not yet in the cache: the whole prompt before prefill, 1 token per decode."""
        return self.num_tokens - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status in (RequestState.FINISHED, RequestState.CANCELLED)


# What every sample of an n > 1 request shares with the request (a fork copies them);
# every other field of a Sequence is the sample's own. tests/test_reliability.py checks
# that each field is in exactly one of the two lists.
REQUEST_FIELDS = ("prompt_ids", "params", "arrival_s", "salt", "priority", "session",
                  "num_computed", "prefix_hit_tokens")  # fmt: skip
SAMPLE_FIELDS = ("request_id", "output_ids", "status", "first_token_s", "finish_s",
                 "finish_reason", "generator", "parent_id", "admit_order", "preemptions",
                 "preempted_at", "stall_s", "notes", "draft_ids", "token_times",
                 "spec_room", "error")  # fmt: skip
