"""The engine's batch API: generate for a list of prompts, serve a workload, read stats.

outputs = engine.generate(["What is the capital of France?"], SamplingParams())
outputs = engine.run(workloads.uniform_chat(16), ignore_eos=True)
engine.stats()            # one row per step (telemetry)
engine.request_stats()    # one row per finished request
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import pandas as pd
from tqdm.auto import tqdm

from kvlab.config import SamplingParams
from kvlab.engine.outputs import RequestOutput
from kvlab.engine.requests import Prompt
from kvlab.sequence import Sequence

if TYPE_CHECKING:
    from kvlab.workloads import Request


class BatchAPI:
    """EngineCore's batch API (a mixin: it queues and steps the core)."""

    def generate(
        self,
        prompts: Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        chat: bool | None = None,
        progress: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns one output per prompt, in order.

        All prompts are validated before any work starts: a bad one raises ValueError and
        nothing is queued.
        """
        if isinstance(prompts, str):
            raise TypeError("generate() takes a list of prompts; wrap a single prompt in [...]")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
        seqs = [self.make_sequence(p, sp, chat=chat) for p, sp in zip(prompts, sampling_params)]
        return self._drain(seqs, progress)

    def run(
        self, requests: Seq[Request], *, ignore_eos: bool = False, progress: bool = False
    ) -> list[RequestOutput]:
        """Serve a workload (kvlab.workloads): request i arrives `arrival_s` after the call.

        Returns one output per request, in order. All requests are validated first.
        `ignore_eos` makes every request produce exactly its max_new_tokens (benchmarks).
        """
        return self._drain(self.workload_sequences(requests, ignore_eos=ignore_eos), progress)

    def workload_sequences(
        self, requests: Seq[Request], *, ignore_eos: bool = False
    ) -> list[Sequence]:
        """The sequences `run` serves for `requests`, each validated, none queued yet:
        request i arrives `arrival_s` after this call."""
        offset = self.clock()
        return [
            self.make_sequence(
                r.prompt,
                SamplingParams(max_new_tokens=r.max_new_tokens, ignore_eos=ignore_eos),
                arrival_s=offset + r.arrival_s,
                salt=r.salt,
                priority=r.priority,
                session=r.session,
            )
            for r in requests
        ]

    def _drain(self, seqs: list[Sequence], progress: bool) -> list[RequestOutput]:
        """Queue `seqs` and step until all of them are finished."""
        for seq in seqs:
            self.enqueue(seq)
        wanted = {seq.request_id: None for seq in seqs}
        total = sum(seq.params.max_new_tokens for seq in seqs)
        with tqdm(total=total, desc="generate", unit="tok", disable=not progress) as bar:
            remaining = len(wanted)
            while remaining:
                before = sum(len(s.output_ids) for s in seqs)
                for out in self.step():
                    if out.request_id in wanted:
                        wanted[out.request_id] = out
                        remaining -= 1
                bar.update(sum(len(s.output_ids) for s in seqs) - before)
        return list(wanted.values())

    def spec_stats(self) -> dict[str, float]:
        """What speculative decoding did so far: drafted, accepted and rejected tokens,
        acceptance rate, output tokens per target forward, blocks rolled back."""
        if self.speculator is None:
            raise ValueError("spec_stats() needs EngineConfig(speculative=...)")
        return self.speculator.stats.as_dict()

    def stats(self) -> pd.DataFrame:
        """Per-step telemetry as a DataFrame (one row per step)."""
        return self.telemetry.frame()

    def request_stats(self) -> pd.DataFrame:
        """One row per finished request: arrival, first token, finish, ttft, tpot, tokens."""
        rows = [
            {
                "request_id": out.request_id,
                "prompt_tokens": len(out.prompt_token_ids),
                "output_tokens": len(out.token_ids),
                "arrival_s": out.metrics.arrival_s,
                "first_token_s": out.metrics.first_token_s,
                "finish_s": out.metrics.finish_s,
                "ttft_s": out.metrics.ttft_s,
                "tpot_s": out.metrics.tpot_s,
                "preemptions": out.metrics.preemptions,
                "stall_s": out.metrics.stall_s,
                "prefix_hit_tokens": out.metrics.prefix_hit_tokens,
                "finish_reason": out.finish_reason,
            }
            for out in self.finished
        ]
        return pd.DataFrame(rows)
