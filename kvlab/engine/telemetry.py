"""One row per engine step, exposed as a pandas DataFrame for plots."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import pandas as pd


@dataclass(frozen=True)
class StepRecord:
    step: int
    time_s: float  # engine clock at the end of the step
    phase: str  # "prefill" | "decode" | "mixed" (chunked prefill beside decodes)
    batch_seqs: int  # sequences in this step's forward
    tokens: int  # tokens computed this step
    running: int  # sequences holding KV memory after the step
    waiting: int  # requests queued after the step
    swapped: int  # requests whose KV sits in host memory
    preemptions: int  # cumulative count
    swapped_bytes: int  # cumulative bytes copied to host memory
    recomputed_tokens: int  # cumulative tokens dropped by recompute preemption
    blocks_used: int  # physical blocks held by sequences (naive: regions)
    blocks_free: int  # free as vLLM counts: never used, or cached with no reference
    group_blocks: tuple[int, ...]  # blocks each KV cache group holds (hybrid; else one)
    prefix_query_tokens: int  # prompt tokens admitted this step
    prefix_hit_tokens: int  # of those, served from the prefix cache
    reserved_bytes: int
    live_bytes: int
    waste_bytes: int
    budget_bytes: int
    step_s: float  # wall time of the step


class Telemetry:
    """Collects StepRecords; `frame()` gives them as a DataFrame.

    `block_maps[i]`, when recorded, lists the owner (request id, or -1 for free) of every
    physical block after step i + 1.
    """

    def __init__(self) -> None:
        self.records: list[StepRecord] = []
        self.block_maps: list[list[int]] = []

    def record(self, row: StepRecord, block_map: list[int] | None = None) -> None:
        self.records.append(row)
        if block_map is not None:
            self.block_maps.append(block_map)

    def frame(self) -> pd.DataFrame:
        columns = list(StepRecord.__dataclass_fields__)
        return pd.DataFrame([asdict(r) for r in self.records], columns=columns)
