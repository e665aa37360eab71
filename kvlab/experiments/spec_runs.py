"""What kvlab.experiments.speculative measures: one SpecRun per configuration and
workload, gathered in a SpecResult (a table, the mismatches, JSON)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd


@dataclass
class SpecRun:
    """One configuration on one workload: sums over its prompts."""

    workload: str
    system: str  # "kvlab" | "hf" | "vllm (eager, block 32)" (kvlab.peers.spec_vllm.SYSTEM)
    method: str  # "none", "ngram", "layers", "prompt-lookup"
    k: int  # most drafts per step (0: no speculation)
    batch_size: int
    output_tokens: int
    decode_tokens: int  # emitted by decode forwards (each request's first token excluded)
    decode_forwards: int  # target forwards after the first token, per request, summed
    drafted: int
    accepted: int
    decode_s: float
    wall_s: float
    identical: bool | None = None  # tokens equal the same system without speculation
    part: str = "k"  # "k": batch 1, against k; "batch": the batch-size sweep
    outputs: list[list[int]] = field(default_factory=list, repr=False)

    @property
    def name(self) -> str:
        return self.method if not self.k else f"{self.method} k={self.k}"

    @property
    def tokens_per_forward(self) -> float:
        return self.decode_tokens / self.decode_forwards if self.decode_forwards else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0

    @property
    def wall_tok_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s else 0.0


@dataclass
class SpecResult:
    runs: list[SpecRun]
    meta: dict = field(default_factory=dict)

    def baseline(self, run: SpecRun) -> SpecRun:
        """The same system on the same workload and batch size, without speculation."""
        return next(
            r
            for r in self.runs
            if (r.part, r.workload, r.system, r.batch_size, r.method)
            == (run.part, run.workload, run.system, run.batch_size, "none")
        )

    def frame(self) -> pd.DataFrame:
        """One row per run; speed-ups are over the same system's no-speculation run."""
        rows = []
        for r in self.runs:
            base = self.baseline(r)
            rows.append(
                {
                    "part": r.part,
                    "workload": r.workload,
                    "system": r.system,
                    "method": r.method,
                    "k": r.k,
                    "batch_size": r.batch_size,
                    "output_tokens": r.output_tokens,
                    "drafted": r.drafted,
                    "accepted": r.accepted,
                    "tokens_per_forward": round(r.tokens_per_forward, 3),
                    "acceptance_rate": round(r.acceptance_rate, 3),
                    "decode_tok_s": round(r.decode_tok_s, 2),
                    "wall_tok_s": round(r.wall_tok_s, 2),
                    "decode_speedup": round(r.decode_tok_s / base.decode_tok_s, 3),
                    "wall_speedup": round(r.wall_tok_s / base.wall_tok_s, 3),
                    "identical": r.identical,
                }
            )
        return pd.DataFrame(rows)

    def mismatches(self) -> list[str]:
        """Runs whose greedy tokens differ from the same system without speculation."""
        return [f"{r.workload}: {r.system} {r.name}" for r in self.runs if r.identical is False]

    def to_json(self) -> dict:
        return {
            "runs": self.frame().to_dict(orient="records"),
            "mismatches": self.mismatches(),
            "meta": self.meta,
        }


def mark_identity(runs: list[SpecRun]) -> None:
    """Set each run's `identical`: its tokens equal its system's no-speculation run's."""
    for run in runs:
        base = next(
            r
            for r in runs
            if (r.system, r.batch_size, r.method) == (run.system, run.batch_size, "none")
        )
        run.identical = run.outputs == base.outputs
