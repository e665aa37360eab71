"""Configuration dataclasses. Each one checks itself and names the field, value and limit."""

from __future__ import annotations

from dataclasses import dataclass

CACHE_KINDS = ("naive", "paged")
BATCHING_MODES = ("continuous", "static")

# Default KV budget when neither kv_budget_bytes nor kv_budget_tokens is given:
# four sequences of 8k tokens, ~1.4 GiB for SmolLM2-135M in fp32.
DEFAULT_BUDGET_TOKENS = 32768
DEFAULT_MAX_MODEL_LEN = 8192


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass
class EngineConfig:
    """How the engine manages its KV cache and batches requests.

    Attributes:
        cache: KV-cache variant: "naive" (one contiguous max_model_len buffer per sequence)
            or "paged" (fixed-size blocks found through a block table).
        block_size: token slots per block of the paged cache.
        max_model_len: longest sequence (prompt + output) in tokens; defaults to the
            model's max_position_embeddings, capped at 8192.
        kv_budget_bytes: KV memory budget in bytes (at most one of the two budget fields).
        kv_budget_tokens: KV memory budget in token slots of the model's KV at the cache's
            dtype; defaults to 32768 when neither budget is given.
        max_num_seqs: most sequences running at once.
        max_prefill_tokens: most prompt tokens prefilled in one step (a longer single
            prompt still runs alone).
        batching: "continuous" (a waiting request joins as soon as memory frees) or
            "static" (a new batch starts only when the whole previous batch is done).
        poison_freed: debug mode: fill freed KV slots with NaN, so a read of another
            sequence's stale state would show up as NaN output.
        record_block_map: keep, for every step, which request owns each physical block
            (for block-map plots; costs one list of num_blocks ints per step).
    """

    cache: str = "naive"
    block_size: int = 16
    max_model_len: int | None = None
    kv_budget_bytes: int | None = None
    kv_budget_tokens: int | None = None
    max_num_seqs: int = 64
    max_prefill_tokens: int = 4096
    batching: str = "continuous"
    poison_freed: bool = False
    record_block_map: bool = False

    def __post_init__(self) -> None:
        _require(
            self.cache in CACHE_KINDS,
            f"EngineConfig.cache={self.cache!r} is unknown; choose one of {CACHE_KINDS}",
        )
        _require(
            self.batching in BATCHING_MODES,
            f"EngineConfig.batching={self.batching!r} is unknown; choose one of {BATCHING_MODES}",
        )
        _require(
            self.kv_budget_bytes is None or self.kv_budget_tokens is None,
            "EngineConfig: give kv_budget_bytes or kv_budget_tokens, not both",
        )
        for name in ("max_model_len", "kv_budget_bytes", "kv_budget_tokens"):
            value = getattr(self, name)
            _require(value is None or value > 0, f"EngineConfig.{name}={value} must be > 0")
        for name in ("block_size", "max_num_seqs", "max_prefill_tokens"):
            value = getattr(self, name)
            _require(value > 0, f"EngineConfig.{name}={value} must be > 0")


@dataclass
class SamplingParams:
    """How one request picks its tokens.

    temperature 0 means greedy. top_k 0 and top_p 1.0 disable those filters. `seed` makes
    sampling reproducible per request. `ignore_eos` keeps generating to max_new_tokens
    (for benchmarks).
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        _require(
            self.max_new_tokens > 0,
            f"SamplingParams.max_new_tokens={self.max_new_tokens} must be >= 1",
        )
        _require(
            self.temperature >= 0, f"SamplingParams.temperature={self.temperature} must be >= 0"
        )
        _require(self.top_k >= 0, f"SamplingParams.top_k={self.top_k} must be >= 0")
        _require(0 < self.top_p <= 1, f"SamplingParams.top_p={self.top_p} must be in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
