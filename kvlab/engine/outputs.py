"""What the engine hands back for each finished request."""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.sequence import Note


@dataclass(frozen=True)
class RequestMetrics:
    """Engine-clock times in seconds (0 = engine creation)."""

    arrival_s: float
    first_token_s: float
    finish_s: float
    num_output_tokens: int
    num_prompt_tokens: int = 0
    prefix_hit_tokens: int = 0  # prompt tokens served from the prefix cache
    preemptions: int = 0  # times its KV was taken away (swapped or dropped)
    stall_s: float = 0.0  # time spent preempted
    token_times: tuple[float, ...] = ()  # when each output token (of sample 0) was emitted

    @property
    def itl_s(self) -> list[float]:
        """Inter-token latencies: the gaps between consecutive output tokens (tokens a
        speculative step emits together have gaps of 0)."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def ttft_s(self) -> float:
        """Time to first token: arrival to the first generated token."""
        return self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float:
        """Time per output token after the first (0 for one-token outputs)."""
        if self.num_output_tokens <= 1:
            return 0.0
        return (self.finish_s - self.first_token_s) / (self.num_output_tokens - 1)

    @property
    def latency_s(self) -> float:
        return self.finish_s - self.arrival_s


@dataclass(frozen=True)
class Sample:
    """One continuation (there are SamplingParams.n of them per request)."""

    token_ids: list[int]
    text: str
    finish_reason: str


@dataclass(frozen=True)
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens only
    text: str
    finish_reason: str  # "eos" | "length" | "max_model_len" | "cancelled" | "error"
    metrics: RequestMetrics
    samples: list[Sample]  # all n continuations; samples[0] is the one above
    notes: tuple[Note, ...] = ()  # why: prefix-cache misses, preemptions (engine.explain)
    error: str | None = None  # finish_reason "error": what its forward or sampling raised
