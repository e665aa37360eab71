"""How much the KV cache holds, in vLLM's words: "KV cache size: N tokens" and "Maximum
concurrency for L tokens per request: X" (the start-up lines vLLM added after users asked
how many requests fit, vllm#8031).

The concurrency is the number of requests of `max_model_len` tokens each whose blocks fit
the pool at once: num_blocks / ceil(max_model_len / block_size) for the paged cache (as
vLLM computes it), the number of max_model_len regions for the naive one. Shorter requests
fit more; prefix sharing fits more still.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvlab.units import ceil_div

if TYPE_CHECKING:
    from kvlab.engine.core import EngineCore as Engine


@dataclass(frozen=True)
class KVCapacity:
    tokens: int  # token slots in the KV pool (num_blocks * block_size)
    num_blocks: int
    block_size: int  # token slots per block (naive: one max_model_len region)
    budget_bytes: int  # bytes of the pool
    max_model_len: int
    max_concurrency: float  # max_model_len-token requests that fit at once

    def lines(self) -> list[str]:
        """The start-up lines, formatted as vLLM logs them."""
        return [
            f"KV cache size: {self.tokens:,} tokens",
            f"Maximum concurrency for {self.max_model_len:,} tokens per request: "
            f"{self.max_concurrency:.2f}x",
        ]


def kv_capacity(engine: Engine) -> KVCapacity:
    """The KV capacity of an engine's cache."""
    cache = engine.cache
    per_request = ceil_div(engine.max_model_len, cache.block_size)
    return KVCapacity(
        tokens=cache.num_blocks * cache.block_size,
        num_blocks=cache.num_blocks,
        block_size=cache.block_size,
        budget_bytes=cache.memory().budget_bytes,
        max_model_len=engine.max_model_len,
        max_concurrency=cache.num_blocks / per_request,
    )
