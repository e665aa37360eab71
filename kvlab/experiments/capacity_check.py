"""The planner checked live: serve identical-length requests on kvlab's engine with a byte
budget, and compare the peak number running at once with the planner's prediction."""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.planner import predict_engine_capacity


@dataclass(frozen=True)
class CapacityCheck:
    predicted: int  # sequences, from the planner
    measured: int  # peak running sequences of the engine's run
    kv_budget_bytes: int
    sequence_len: int  # prompt + output tokens per request
    cache: str
    kv_codec: str | None

    @property
    def error(self) -> float:
        """(measured - predicted) / measured."""
        return (self.measured - self.predicted) / self.measured


def check_against_engine(
    model,
    kv_budget_bytes: int,
    prompt_len: int = 24,
    output_len: int = 8,
    cache: str = "paged",
    block_size: int = 16,
    kv_codec: str | None = None,
    max_model_len: int = 128,
    extra_requests: int = 4,
) -> CapacityCheck:
    """Serve identical-length requests (more than fit) on kvlab's engine with this byte
    budget and compare the peak number running at once with the planner's prediction.

    Prompts are distinct windows of the held-out text (token ids), so nothing is shared.
    """
    from kvlab import texts
    from kvlab.build import Engine
    from kvlab.config import EngineConfig
    from kvlab.workloads import Request

    sequence_len = prompt_len + output_len
    predicted = predict_engine_capacity(
        model.config,
        kv_budget_bytes,
        sequence_len,
        cache,
        block_size,
        kv_codec,
        model.dtype,
        max_model_len,
    )
    n = predicted + extra_requests
    ids = model.tokenizer.encode(texts.heldout())
    if len(ids) < n + prompt_len:
        raise ValueError(f"{n} requests of {prompt_len} tokens need a longer text")
    requests = [Request(ids[i : i + prompt_len], output_len) for i in range(n)]
    config = EngineConfig(
        cache=cache,
        block_size=block_size,
        kv_codec=kv_codec,
        kv_budget_bytes=kv_budget_bytes,
        max_model_len=max_model_len,
        admission="reserve",  # the planner counts sequences that fit whole, to the end
        max_num_seqs=n,
        max_num_batched_tokens=max(4096, n * prompt_len),  # admit them all in one step
    )
    engine = Engine(model, config)
    engine.run(requests, ignore_eos=True)
    measured = int(engine.stats()["running"].max())
    return CapacityCheck(predicted, measured, kv_budget_bytes, sequence_len, cache, kv_codec)
