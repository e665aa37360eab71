"""Speculative decoding measured: kvlab's proposers beside HF's prompt lookup, one run.

    result = compare_speculation(model, spec_workloads(model, 2, 2))
    result.frame()        # one row per (workload, system, method, k): tokens per target
                          # forward, acceptance, decode and wall tok/s, speed-up, identity
    result.mismatches()   # greedy runs whose tokens differ from no speculation (must be [])
    batch_sweep(model, "doc-qa", requests, spec, (1, 4, 16))  # where drafts stop paying

Every run is greedy, so a speculative run must emit exactly the tokens of the same
system without speculation; `identical` says whether it did.

Every system is timed the same way: each prompt alone (batch 1), prefilled inside its
time from an empty prefix cache, after an untimed warm-up; `wall_s` (the speed-up the
tables compare) holds the prefill, `decode_s` does not (for vLLM, which times whole runs
only, it is `wall_s`).

kvlab: one paged engine with prefix caching per workload. Each prompt is prefilled once
and every configuration runs the first prompt briefly, untimed (first-call costs;
`prefill_s` keeps the prefill's time); then every configuration runs every prompt, one
at a time, the prefix cache emptied before each run (`reset_prefix_cache`), so the
prompt's prefill is inside the run, as it is for HF and vLLM (`cold=False`: the prefix
cache is kept, so every run decodes from the prompt's cached K/V and wall_s holds almost
no prefill); the order of the configurations alternates from prompt to prompt (this
machine is shared). The engine's speculation is swapped between runs
(`set_speculation`); each configuration keeps one Speculator, so its SpecStats add up
over the prompts. `decode_s` sums the step_s of
decode steps (the draft model's work included; prompt lookup runs just before the step),
`wall_s` is the whole `generate` call.

HF: `generate`, plain or with `prompt_lookup_num_tokens=k` (its n-gram drafting, here
with n-grams of up to PROMPT_LOOKUP_MAX tokens, down to 1), one prompt at a time
(kvlab.peers.spec_hf). Each run prefills its prompt (HF's prompt lookup cannot
start from a prefilled cache): its `decode_s` starts at its second forward, its `wall_s`
includes the prefill. Its target forwards are counted by a hook, so its tokens per
forward and acceptance come from the same arithmetic as kvlab's.

The batch-size sweep (`batch_sweep`, kvlab only) cycles one workload's prompts to each
batch size and runs them at once, with and without n-gram drafting, on the same engine
with the prompts cached: it measures decoding as the batch grows.
vLLM (`vllm=True`, where `make peers` built .venv-vllm): its engine without speculation
and with n-gram drafting at each k, batch 1, EOS ignored, eager at block size 32 and
named so, "vllm (eager, block 32)" (kvlab.peers.spec_vllm); its drafted and accepted
tokens are its own counts (from an untimed pass with its stats on), its decode_s is its
whole run.

`verify_cost` times the model's first MLP on 1 + k rows: what a verify forward costs
against a plain decode on this device.
"""

from __future__ import annotations

import time
from functools import partial

import torch

from kvlab.build import Engine
from kvlab.config import SpeculativeConfig
from kvlab.experiments.spec_kvlab import (  # noqa: F401 (re-exported for notebooks)
    batch_sweep,
    kvlab_batch_run,
    prefix_engine,
    run_kvlab,
    set_speculation,
)
from kvlab.experiments.spec_runs import SpecResult, SpecRun, mark_identity  # noqa: F401
from kvlab.model.loading import LoadedModel
from kvlab.workloads import Request, chat, doc_qa, encode_requests

DEFAULT_KS = (1, 2, 4, 8)
PROMPT_LOOKUP_MIN = 2  # kvlab's n-gram: 2-grams and longer (1-grams match too eagerly)
PROMPT_LOOKUP_MAX = 4
LAYERS_K = 2  # the "layers" draft guesses poorly: a short draft wastes less


def spec_workloads(
    model: LoadedModel,
    doc_qa_prompts: int = 2,
    chat_prompts: int = 2,
    max_new_tokens: int = 64,
    max_prompt_tokens: int | None = None,
    seed: int = 0,
) -> dict[str, list[Request]]:
    """Doc-QA (input-grounded: answers quote the document) and chat requests as token
    ids, answers capped at max_new_tokens (they stop at EOS before that).

    The doc-QA requests are the first of a seeded doc_qa(16) (every document once) whose
    prompts fit in max_prompt_tokens (default: the model's context less the answer)."""
    limit = max_prompt_tokens or model.config.max_position_embeddings - max_new_tokens - 16
    answer = (max_new_tokens, max_new_tokens)
    pool = encode_requests(model, doc_qa(16, seed=seed, long_fraction=1.0, long_answer=answer))
    docs = [r for r in pool if len(r.prompt) <= limit][:doc_qa_prompts]
    chats = encode_requests(model, chat(chat_prompts, seed=seed, max_new_tokens=answer))
    return {"doc-qa": docs, "chat": chats}


def kvlab_specs(
    ks: tuple[int, ...] = DEFAULT_KS,
    layers_k: int | None = LAYERS_K,
    ngram_min: int = PROMPT_LOOKUP_MIN,
) -> dict[str, SpeculativeConfig | None]:
    """The kvlab configurations compared: none, n-gram at each k, the "layers" draft."""
    specs: dict[str, SpeculativeConfig | None] = {"none": None}
    for k in ks:
        specs[f"ngram k={k}"] = SpeculativeConfig(
            "ngram", k, prompt_lookup_min=ngram_min, prompt_lookup_max=PROMPT_LOOKUP_MAX
        )
    if layers_k:
        specs[f"layers k={layers_k}"] = SpeculativeConfig("layers", layers_k)
    return specs


def hf_runs(
    model: LoadedModel, workload: str, requests: list[Request], ks: tuple[int, ...]
) -> list[SpecRun]:
    """HF `generate`, plain and with prompt lookup at each k, batch 1 (kvlab.peers.spec_hf);
    n-grams of up to PROMPT_LOOKUP_MAX tokens, as kvlab's."""
    from kvlab.peers.spec_hf import run_hf

    prompts = [list(r.prompt) for r in requests]
    done = run_hf(model, prompts, [r.max_new_tokens for r in requests], ks, PROMPT_LOOKUP_MAX)
    runs = []
    for k, a in done.items():
        tokens, forwards = sum(map(len, a["outputs"])), len(a["lengths"])
        decoded = tokens - len(prompts)  # each prompt's forward emits its first token
        drafted = sum(n - 1 for n in a["lengths"])
        method = "prompt-lookup" if k else "none"
        runs.append(
            SpecRun(workload, "hf", method, k, 1, tokens, decoded, forwards, drafted,
                    max(0, decoded - forwards), a["decode_s"], a["wall_s"], outputs=a["outputs"])
        )  # fmt: skip
    return runs


def vllm_runs(
    model: LoadedModel,
    workload: str,
    requests: list[Request],
    ks: tuple[int, ...],
    lookup_min: int,
    lookup_max: int,
    threads: int | None = None,
    baseline: bool = True,
    timed: bool = True,
) -> list[SpecRun]:
    """vLLM without speculation (unless `baseline` is False) and with n-gram drafting at
    each k, batch 1 (kvlab.peers.spec_vllm), as system SYSTEM ("vllm (eager, block
    32)"); its decode_s is its whole run. `timed=False`: tokens and drafts only, from
    the counting pass (kvlab.peers.spec_vllm.run_vllm)."""
    from kvlab.peers.spec_vllm import SYSTEM, run_vllm

    prompts = [list(r.prompt) for r in requests]
    new_tokens = [r.max_new_tokens for r in requests]
    done = run_vllm(
        model, prompts, new_tokens, ks, lookup_min, lookup_max, threads, baseline, timed=timed
    )
    runs = []
    for k, run in done.items():
        tokens = sum(map(len, run.outputs))
        runs.append(
            SpecRun(workload, SYSTEM, "ngram" if k else "none", k, 1, tokens,
                    tokens - len(prompts), run.steps - len(prompts), run.drafted,
                    run.accepted, run.run_s, run.run_s, outputs=run.outputs)
        )  # fmt: skip
    return runs


def compare_speculation(
    model: LoadedModel,
    workloads: dict[str, list[Request]],
    ks: tuple[int, ...] = DEFAULT_KS,
    layers_k: int | None = LAYERS_K,
    hf: bool = True,
    sweep_workload: str | None = "doc-qa",
    sweep_batch_sizes: tuple[int, ...] = (1, 4, 16),
    sweep_k: int = 4,
    engines: dict[str, Engine] | None = None,
    ngram_min: int = PROMPT_LOOKUP_MIN,
    vllm: bool = False,
    repeats: int = 1,
    cold: bool = True,
) -> SpecResult:
    """kvlab (no speculation, n-gram at each k, the "layers" draft), HF (plain and
    prompt lookup at each k) and, with `vllm`, vLLM (plain and n-gram at each k, with
    kvlab's prompt_lookup_min and _max) on every workload at batch 1, then the batch-size
    sweep of n-gram at `sweep_k` on `sweep_workload`; see the module doc. `engines`: an
    idle prefix-caching engine per workload to reuse (its cached prompts save the
    warm-up's prefills and the sweep's).
    `ngram_min`: kvlab's prompt_lookup_min (HF's prompt lookup always goes down to 1).
    `repeats`: kvlab's rounds per run, its fastest kept (kvlab.experiments.spec_kvlab).
    `cold`: kvlab's batch-1 runs start from an empty prefix cache, their prefill inside
    their wall_s, as the peers' are (False: each prompt is prefilled once, untimed, and
    every run decodes from its cached K/V; wall_s then holds almost no prefill)."""
    runs, meta = [], {"prefill_s": {}, "kvlab_vs_hf_identical": {}}
    if vllm:
        meta["kvlab_vs_vllm_identical"] = {}
    specs = kvlab_specs(ks, layers_k, ngram_min)
    engines = dict(engines or {})
    for name, requests in workloads.items():
        requests = encode_requests(model, requests)
        ours, meta["prefill_s"][name], engines[name] = run_kvlab(
            model, name, requests, specs, engines.get(name), cold=cold, repeats=repeats
        )
        mark_identity(ours)
        runs += ours
        peers = {"hf": hf_runs} if hf else {}
        if vllm:
            peers["vllm"] = partial(
                vllm_runs,
                lookup_min=ngram_min,
                lookup_max=PROMPT_LOOKUP_MAX,
                threads=torch.get_num_threads(),
            )  # as many as kvlab's
        for peer, peer_runs in peers.items():
            theirs = peer_runs(model, name, requests, ks)
            mark_identity(theirs)
            runs += theirs
            eos = set(engines[name].eos_ids)
            meta[f"kvlab_vs_{peer}_identical"][name] = _agreement(ours[0], theirs[0], eos)
    if sweep_workload and sweep_batch_sizes:
        requests = encode_requests(model, workloads[sweep_workload])
        spec = kvlab_specs((sweep_k,), None, ngram_min)[f"ngram k={sweep_k}"]
        runs += batch_sweep(
            model, sweep_workload, requests, spec, sweep_batch_sizes,
            engines.get(sweep_workload), repeats=repeats,
        )  # fmt: skip
    meta["prompt_tokens"] = {
        name: [len(r.prompt) for r in encode_requests(model, reqs)]
        for name, reqs in workloads.items()
    }
    return SpecResult(runs, meta)


def _agreement(ours: SpecRun, theirs: SpecRun, eos: set[int]) -> str:
    """How many prompts' greedy tokens (up to EOS) are the same in both runs."""
    same = [_to_eos(a, eos) == _to_eos(b, eos) for a, b in zip(ours.outputs, theirs.outputs)]
    return f"{sum(same)}/{len(same)} prompts"


def _to_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i]
    return tokens


@torch.inference_mode()
def verify_cost(
    model: LoadedModel, rows: tuple[int, ...] = (1, 2, 3, 5, 9, 17), repeats: int = 20
) -> dict[int, float]:
    """Milliseconds of the model's first MLP on `rows` tokens at once (the best of
    `repeats`): what computing 1 + k tokens in one forward costs against 1 on this device.
    On a GPU a few more rows are nearly free; on a CPU each row adds compute."""
    mlp = model.hf_model.model.layers[0].mlp
    hidden = model.config.hidden_size
    costs = {}
    for m in rows:
        x = torch.randn(1, m, hidden, dtype=model.dtype, device=model.device)
        mlp(x)  # warm-up
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            mlp(x)
            best = min(best, time.perf_counter() - start)
        costs[m] = round(1000 * best, 3)
    return costs
