"""vLLM as the oracle of kvlab's accounting: same model, token ids, block size and KV bytes.

    report = run_oracle(model)  # one vLLM worker for everything (a minute or two)
    report.capacity()           # KV blocks / tokens for a byte budget, both sides
    report.requests()           # per request: prefix-hit tokens and tokens, both sides
    run_oracle(model, runs=QUICK_RUNS)  # the tight budget's run alone: one vLLM engine

vLLM (`.venv-vllm`, kvlab.peers.vllm_peer) loads kvlab's safetensors copy of the
embedded model; both sides use block size 32 (vLLM's CPU attention takes multiples of
32 only) and the model's dtype. vLLM runs in process (VLLM_ENABLE_V1_MULTIPROCESSING=0),
so each of its steps schedules every request added before it, as kvlab's do; its step
budget, sequence cap and chunked prefill are kvlab's (`oracle_config`). Its worker runs
in a thread on one core while kvlab computes its side on the other (one torch thread).

Workloads: doc-QA (its two shortest documents under one ~300-token preamble), a chat
whose six users share one system prompt (each run with all requests arriving together
and one by one, at a roomy budget), and eight chat answers of 40 tokens that outgrow a
tight budget.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import pandas as pd
import torch

from kvlab import texts
from kvlab.build import Engine
from kvlab.config import EngineConfig
from kvlab.model.loading import LoadedModel
from kvlab.peers.vllm_peer import VLLM_BLOCK_SIZE, VllmPeer, vllm_engine_args
from kvlab.presets import model_bytes_per_token
from kvlab.workloads import Request, doc_qa, encode_requests, uniform_chat

BLOCK = VLLM_BLOCK_SIZE
# name -> (KV bytes, max_model_len); vLLM wants one max_model_len sequence to fit.
BUDGETS = {"roomy": (200_000_000, 2048), "tight": (23_000_000, 256)}
STEP_TOKENS, MAX_SEQS = 4096, 16
ARRIVALS = ("together", "one-by-one")
# workload -> (budget, arrival patterns)
RUNS = {
    "doc-qa": ("roomy", ARRIVALS),
    "shared-prefix-chat": ("roomy", ARRIVALS),
    "pressure": ("tight", ("together",)),
}
# The smallest oracle that still fills every table (benchmarks/vllm_oracle.py --quick):
# one budget, so one vLLM engine; the capacity of that budget only.
QUICK_RUNS = {"pressure": ("tight", ("together",))}


def block_bytes(model: LoadedModel) -> int:
    return BLOCK * model_bytes_per_token(model)


def oracle_config(model: LoadedModel, budget_bytes: int, max_model_len: int) -> EngineConfig:
    """kvlab's side: the paged cache with hash prefix caching and its default admission,
    vLLM V1's step shape (running requests first, long prompts chunked to the step
    budget, preempted ones recomputed)."""
    return EngineConfig(
        cache="paged",
        block_size=BLOCK,
        prefix_caching="hash",
        kv_budget_bytes=budget_bytes,
        max_model_len=max_model_len,
        max_num_seqs=MAX_SEQS,
        max_num_batched_tokens=STEP_TOKENS,
        chunked_prefill=True,
        schedule_order="decode-first",
        preemption="recompute",
    )


def oracle_workloads(model: LoadedModel) -> dict[str, list[Request]]:
    """The token-id workloads of RUNS (see the module doc)."""
    docs = sorted(encode_requests(model, doc_qa(n=16, seed=0)), key=lambda r: len(r.prompt))
    system = texts.preamble()
    chat = [
        Request(
            model.tokenizer.apply_chat_template(
                [{"role": "system", "content": system}, {"role": "user", "content": text}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            ),
            16,
        )
        for text in texts.chat_prompts()[:6]
    ]
    return {
        "doc-qa": [replace(r, max_new_tokens=8) for r in docs[:2]],
        "shared-prefix-chat": [replace(r, prompt=list(r.prompt)) for r in chat],
        "pressure": encode_requests(model, uniform_chat(8, max_new_tokens=40)),
    }


def ask_vllm(model: LoadedModel, traffic: dict[str, list[Request]], runs: dict = RUNS) -> dict:
    """Every vLLM answer of `runs` from one worker, one engine per budget they use:
    {budget name: VllmEngine, (workload, arrival): VllmRun}."""
    answers = {}
    with VllmPeer(threads=1, inproc=True) as peer:
        for name, (budget, length) in BUDGETS.items():
            if all(where != name for where, _ in runs.values()):
                continue
            args = vllm_engine_args(model, budget, length, BLOCK, MAX_SEQS, STEP_TOKENS)
            answers[name] = peer.start(args, stats=True)  # peak running, preemptions
            for workload, (where, arrivals) in runs.items():
                if where != name:
                    continue
                requests = traffic[workload]
                for arrival in arrivals:
                    answers[workload, arrival] = peer.run(
                        [r.prompt for r in requests],
                        [r.max_new_tokens for r in requests],
                        arrival=arrival,
                        reset_prefix_cache=True,
                    )
            peer.stop()
    return answers


def kvlab_side(model: LoadedModel, requests: list[Request], budget: str, arrival: str):
    """kvlab's side of one run: (engine, outputs). kvlab gets vLLM's usable KV: the
    budget less one block (vLLM's null block, which pads block tables)."""
    budget_bytes, length = BUDGETS[budget]
    engine = Engine(model, oracle_config(model, budget_bytes - block_bytes(model), length))
    if arrival == "together":
        outputs = engine.run(requests, ignore_eos=True)
    else:
        outputs = [out for r in requests for out in engine.run([r], ignore_eos=True)]
    engine.cache.check_integrity()
    return engine, outputs


@dataclass
class OracleReport:
    """Both sides of every run of RUNS (or of the runs `run_oracle` was given)."""

    model: LoadedModel
    vllm: dict  # from ask_vllm
    kvlab: dict  # (workload, arrival) -> (engine, outputs)

    def capacity(self) -> pd.DataFrame:
        """Per budget vLLM ran: blocks and token slots for the bytes, kvlab and vLLM."""
        rows = {}
        for name, (budget, length) in BUDGETS.items():
            if name not in self.vllm:
                continue
            cache = Engine(self.model, oracle_config(self.model, budget, length)).cache
            theirs = self.vllm[name]
            rows[name] = {
                "kv_bytes": budget,
                "kvlab_blocks": cache.num_blocks,
                "vllm_blocks": theirs.num_blocks,
                "kvlab_tokens": cache.pool.num_slots,
                "vllm_logged_tokens": theirs.logged_kv_tokens,
                "vllm_usable_blocks": theirs.usable_blocks,
            }
        return pd.DataFrame.from_dict(rows, orient="index")

    def requests(self) -> pd.DataFrame:
        """Per request of every run: prefix-hit tokens and whether the tokens agree."""
        rows = []
        for (workload, arrival), (_, outputs) in self.kvlab.items():
            theirs = self.vllm[workload, arrival]
            for i, out in enumerate(outputs):
                rows.append(
                    {
                        "workload": workload,
                        "arrival": arrival,
                        "request": i,
                        "kvlab_hit_tokens": out.metrics.prefix_hit_tokens,
                        "vllm_hit_tokens": theirs.num_cached_tokens[i],
                        "tokens_identical": out.token_ids == theirs.outputs[i],
                    }
                )
        return pd.DataFrame(rows)

    def pressure(self) -> pd.DataFrame:
        """The tight-budget run: peak running requests and preemptions, both sides."""
        engine, _ = self.kvlab["pressure", "together"]
        theirs = self.vllm["pressure", "together"]
        return pd.DataFrame(
            {
                "kvlab": [int(engine.stats()["running"].max()), engine.scheduler.preemptions],
                "vllm": [theirs.peak_running, theirs.preemptions],
            },
            index=["peak_running", "preemptions"],
        )


def run_oracle(model: LoadedModel, runs: dict = RUNS) -> OracleReport:
    """Every run of `runs` (RUNS, or some of them) on both sides: vLLM in a thread (its
    own process, one core), kvlab meanwhile in this thread on one torch thread."""
    traffic = oracle_workloads(model)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(1) as pool:
            answers = pool.submit(ask_vllm, model, traffic, runs)
            ours = {
                (workload, arrival): kvlab_side(model, traffic[workload], budget, arrival)
                for workload, (budget, arrivals) in runs.items()
                for arrival in arrivals
            }
            return OracleReport(model, answers.result(), ours)
    finally:
        torch.set_num_threads(threads)
