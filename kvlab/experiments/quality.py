"""What a KV codec costs in quality and buys in capacity, measured on the real model.

- `teacher_forced`: the held-out text (kvlab.texts.heldout) fed through the runner in
  chunks, like a chunked prefill, so every later chunk attends to K/V that earlier chunks
  wrote through the codec. Per codec: perplexity, KL(baseline || codec) of the next-token
  distributions, and how often the top-1 token matches the baseline's. The baseline (the
  model's dtype) runs in lockstep, so only one chunk's logits are ever held.
- `roundtrip` / `kv_error`: the codec alone on the baseline's real K/V (write, gather).
- `stepwise_agreement` (the report's greedy_agreement): along the baseline's greedy
  answers to chat prompts, how often the codec picks the same greedy token given the
  same history; every step reads its K/V back through the codec, as decode does.
- `greedy_tokens` / `agreement` (free_run_agreement): the engine (paged cache) answering
  chat prompts greedily with and without the codec; the fraction of positions where the
  tokens match. Strict: after a first difference the rest usually differs too, and a
  token one answer has and the other lacks counts as a difference.
- `capacity`: how many requests of a workload the paged cache admits at once from a
  full queue at one byte budget (worst-case reservation of prompt + max_new_tokens, first
  come first served, as the scheduler admits). It is counted, not run: no forward pass.
  kivi2's full-precision windows (per sequence, outside bytes per token) are paid for
  out of the budget first.
- `codec_report`: all of it, one row per codec.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd
import torch
import torch.nn.functional as F

from kvlab import texts, workloads
from kvlab.build import Engine
from kvlab.cache.codecs import CODECS
from kvlab.cache.pool import KVPool
from kvlab.cache.spec import KVSpec
from kvlab.config import EngineConfig, SamplingParams
from kvlab.model.loading import LoadedModel
from kvlab.model.metadata import build_attention_metadata
from kvlab.model.runner import ModelRunner
from kvlab.units import MiB, round_up

BASELINE = "baseline"  # the codec column's name for kv_codec=None


def named(kv_codecs: Sequence[str] | None) -> list[str]:
    """The codecs to measure: the given names, or every registered codec (None)."""
    return list(CODECS.names() if kv_codecs is None else kv_codecs)


def label(kv_codec: str | None) -> str:
    return BASELINE if kv_codec is None else kv_codec


def _slots_for(num_tokens: int) -> int:
    return round_up(num_tokens, 64)  # a multiple of every codec's alignment


def heldout_ids(model: LoadedModel, num_tokens: int | None = None) -> list[int]:
    """The held-out prose as token ids (no chat template), the first `num_tokens` of them."""
    return list(model.tokenizer.encode(texts.heldout()))[:num_tokens]


@dataclass
class TeacherForcing:
    frame: pd.DataFrame  # one row per codec, baseline first
    k: torch.Tensor  # (layers, tokens, kv_heads, head_dim): the baseline's keys, after RoPE
    v: torch.Tensor  # (layers, tokens, kv_heads, head_dim)


def teacher_forced(
    runner: ModelRunner,
    ids: Sequence[int],
    kv_codecs: Sequence[str] | None = None,
    chunk: int = 128,
    scored_from: int = 0,
) -> TeacherForcing:
    """Score ids[1:] given ids[:-1], in chunks, for the baseline and every codec.

    Only predictions made at positions >= scored_from count (the earlier tokens are
    context, e.g. a prompt before its answer).
    """
    n = len(ids) - 1  # tokens fed; each predicts the next
    if not 0 <= scored_from < n:
        raise ValueError(f"need scored_from={scored_from} in [0, {n}) for {len(ids)} token ids")
    slots = _slots_for(n)
    names = [None, *named(kv_codecs)]
    pools = {
        name: KVPool(runner.kv_spec, slots, runner.dtype, runner.device, name) for name in names
    }
    totals = {name: torch.zeros(3, dtype=torch.float64) for name in names}  # nll, kl, top1
    tokens = torch.tensor(ids, dtype=torch.long, device=runner.device)
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        meta = build_attention_metadata([start], [end - start], [[0]], slots, runner.device)
        skip = max(scored_from - start, 0)  # rows of this chunk that are context only
        target = tokens[start + 1 + skip : end + 1, None]
        base = None
        for name, pool in pools.items():
            logits = runner.forward(tokens[start:end], meta, pool, all_logits=True)
            logp = F.log_softmax(logits[skip:], -1)
            base = logp if name is None else base
            totals[name] += torch.stack(
                [
                    -logp.gather(1, target).sum(),
                    (base.exp() * (base - logp)).sum(),
                    (logp.argmax(-1) == base.argmax(-1)).sum(),
                ]
            ).double()
    rows = []
    for name in names:
        nll, kl, top1 = (totals[name] / (n - scored_from)).tolist()
        rows.append(
            {
                "codec": label(name),
                "ppl": float(torch.tensor(nll).exp()),
                "kl": kl,
                "top1_agreement": top1,
            }
        )
    frame = pd.DataFrame(rows)
    frame["ppl_increase_pct"] = 100 * (frame["ppl"] / frame["ppl"].iloc[0] - 1)
    k, v = pools[None].k[:, :n].clone(), pools[None].v[:, :n].clone()
    return TeacherForcing(frame, k, v)


def roundtrip(
    kv_codec: str | None, k: torch.Tensor, v: torch.Tensor, chunk: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V written through a codec in chunks and read back. k, v: (layers, N, heads, dim)."""
    layers, n, heads, dim = k.shape
    pool = KVPool(KVSpec(layers, heads, dim), _slots_for(n), k.dtype, k.device, kv_codec)
    for start in range(0, n, chunk):
        slots = torch.arange(start, min(start + chunk, n), device=k.device)
        for layer in range(layers):
            pool.write(layer, slots, k[layer, slots], v[layer, slots])
    every = torch.arange(n, device=k.device)[None]
    decoded = [pool.gather(layer, every) for layer in range(layers)]
    return torch.stack([d[0][0] for d in decoded]), torch.stack([d[1][0] for d in decoded])


def kv_error(kv_codec: str | None, k: torch.Tensor, v: torch.Tensor) -> dict[str, float]:
    """Max and mean absolute error of the codec on these K/V (layers, N, heads, dim)."""
    k_hat, v_hat = roundtrip(kv_codec, k, v)
    k_err, v_err = (k_hat - k).abs(), (v_hat - v).abs()
    return {
        "k_max_err": float(k_err.max()),
        "k_mean_err": float(k_err.mean()),
        "v_max_err": float(v_err.max()),
        "v_mean_err": float(v_err.mean()),
    }


def greedy_tokens(
    model: LoadedModel,
    kv_codec: str | None,
    prompts: Sequence[str],
    new_tokens: int = 32,
    max_model_len: int = 512,
) -> list[list[int]]:
    """Greedy answers of the paged engine for every prompt (to EOS, at most new_tokens)."""
    config = EngineConfig(
        cache="paged",
        kv_codec=kv_codec,
        max_model_len=max_model_len,
        kv_budget_tokens=len(prompts) * max_model_len,
    )
    params = SamplingParams(max_new_tokens=new_tokens)
    return [out.token_ids for out in Engine(model, config).generate(list(prompts), params)]


def stepwise_agreement(
    runner: ModelRunner,
    prompts: Sequence[Sequence[int]],
    answers: Sequence[Sequence[int]],
    kv_codecs: Sequence[str] | None = None,
) -> dict[str, float]:
    """Per codec: how often its greedy choice equals the baseline's at each step of the
    baseline's greedy answers, every step given the same history (the answer so far).

    Each prompt + answer runs through the codec's pool like a prefill and a run of decode
    steps (every token attends to K/V read back through the codec); the baseline runs in
    lockstep. Unlike `agreement` of free-running answers, one near-tie costs one token,
    not the rest of the answer. Answer-weighted over all prompts.
    """
    kv_codecs = named(kv_codecs)
    hits = dict.fromkeys([BASELINE, *map(label, kv_codecs)], 0.0)
    total = 0
    for prompt, answer in zip(prompts, answers):
        if not answer:
            continue
        ids = [*prompt, *answer]
        frame = teacher_forced(runner, ids, kv_codecs, scored_from=len(prompt) - 1).frame
        for codec, top1 in zip(frame["codec"], frame["top1_agreement"]):
            hits[codec] += top1 * len(answer)
        total += len(answer)
    if not total:
        raise ValueError("no answer tokens to compare")
    return {codec: value / total for codec, value in hits.items()}


def agreement(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> float:
    """Fraction of positions, over all outputs, where the two token lists match."""
    same = sum(x == y for ta, tb in zip(a, b) for x, y in zip(ta, tb))
    total = sum(max(len(ta), len(tb)) for ta, tb in zip(a, b))
    return same / total if total else 1.0


def capacity(
    model: LoadedModel,
    kv_codec: str | None,
    budget_bytes: int,
    requests: Sequence[workloads.Request] | Sequence[tuple[list[int], int]],
    max_model_len: int = 2048,
) -> int:
    """Requests the paged cache admits at once, in order, from a full queue, each
    promised its worst case (reserve admission: every one of them runs to its end).

    `requests`: workload requests, or (prompt ids, max_new_tokens) pairs (tokenized once).
    A codec with a full-precision window (kivi2) pays for it out of the budget: every
    admitted sequence's window_tokens at the model's dtype are set aside first. A request
    too big for the whole budget stops the count, as it would block the queue.
    """
    pairs = [
        (r.prompt, r.max_new_tokens) if isinstance(r, workloads.Request) else r for r in requests
    ]
    held = _admitted(model, kv_codec, budget_bytes, pairs, max_model_len)
    window = CODECS[kv_codec].window_tokens
    if window and held:
        runner = ModelRunner(model.hf_model)
        per_seq = window * CODECS[None].token_bytes(runner.kv_spec, runner.dtype)
        # Feasible: at most `held` windows are set aside, and fewer sequences are admitted.
        held = _admitted(model, kv_codec, budget_bytes - held * per_seq, pairs, max_model_len)
    return held


def _admitted(
    model: LoadedModel,
    kv_codec: str | None,
    budget_bytes: int,
    pairs: list[tuple[str | list[int], int]],
    max_model_len: int,
) -> int:
    # Reserve admission: a request counts once its whole answer fits, so the count is
    # what the budget holds to the end, without preemption.
    config = EngineConfig(
        cache="paged",
        admission="reserve",
        kv_codec=kv_codec,
        kv_budget_bytes=budget_bytes,
        max_model_len=max_model_len,
    )
    engine = Engine(model, config)
    admitted = 0
    for prompt, new_tokens in pairs:
        try:
            seq = engine.make_sequence(prompt, SamplingParams(max_new_tokens=new_tokens))
        except ValueError:  # it could never fit this budget: the queue stops here
            break
        if not engine.cache.can_admit(seq):
            break
        engine.cache.admit(seq)
        admitted += 1
    return admitted


def bytes_table(
    spec: KVSpec, dtype: torch.dtype, kv_codecs: Sequence[str] | None = None
) -> pd.DataFrame:
    """Bytes per token of every codec for a model's KV shape, scales included."""
    rows = []
    for name in (None, *named(kv_codecs)):
        cls = CODECS[name]
        rows.append(
            {"codec": label(name), "describe": cls.describe,
             "bytes_per_token": cls.token_bytes(spec, dtype)}
        )  # fmt: skip
    frame = pd.DataFrame(rows)
    frame["x_smaller"] = frame["bytes_per_token"].iloc[0] / frame["bytes_per_token"]
    return frame


def codec_report(
    model: LoadedModel,
    kv_codecs: Sequence[str] | None = None,
    *,
    text_tokens: int = 1024,
    chunk: int = 128,
    prompts: Sequence[str] | None = None,
    new_tokens: int = 48,
    free_run: int = 16,
    budget_bytes: int = 256 * MiB,
    requests: Sequence[workloads.Request] | None = None,
    forcing: TeacherForcing | None = None,
) -> pd.DataFrame:
    """One row per codec (baseline first): bytes, perplexity, KL, agreements, K/V error, capacity.

    Defaults: the first `text_tokens` of the held-out text; all 64 chat prompts
    (kvlab.texts) answered with up to `new_tokens` greedy tokens; 64 doc-QA requests with
    short answers at `budget_bytes`. free_run_agreement (one engine run per codec, the
    costly part) uses the first `free_run` prompts.
    `forcing` reuses a teacher_forced() result computed on the same codecs.
    """
    runner, kv_codecs = ModelRunner(model.hf_model), named(kv_codecs)
    if forcing is None:
        forcing = teacher_forced(runner, heldout_ids(model, text_tokens), kv_codecs, chunk)
    prompts = list(prompts) if prompts is not None else texts.chat_prompts()
    if requests is None:
        requests = workloads.doc_qa(n=64, long_fraction=0.0)
    engine = Engine(model, EngineConfig(cache="paged", kv_budget_tokens=16))
    encoded = [(engine.encode(r.prompt), r.max_new_tokens) for r in requests]
    names = [None, *kv_codecs]
    reference = greedy_tokens(model, None, prompts, new_tokens)
    prompt_ids = [engine.encode(p) for p in prompts]
    stepwise = stepwise_agreement(runner, prompt_ids, reference, kv_codecs)
    rows = []
    for name in names:
        cls = CODECS[name]
        free = prompts[:free_run]
        tokens = reference if name is None else greedy_tokens(model, name, free, new_tokens)
        rows.append(
            {
                "codec": label(name),
                "describe": cls.describe,
                "bytes_per_token": cls.token_bytes(runner.kv_spec, runner.dtype),
                "greedy_agreement": stepwise[label(name)],
                "free_run_agreement": agreement(reference[:free_run], tokens[:free_run]),
                **kv_error(name, forcing.k, forcing.v),
                "capacity": capacity(model, name, budget_bytes, encoded),
            }
        )
    frame = forcing.frame.merge(pd.DataFrame(rows), on="codec")
    frame["capacity_x"] = frame["capacity"] / frame["capacity"].iloc[0]
    columns = ["codec", "describe", "bytes_per_token", "ppl", "ppl_increase_pct", "kl",
               "top1_agreement", "greedy_agreement", "free_run_agreement", "k_max_err",
               "k_mean_err", "v_max_err", "v_mean_err", "capacity", "capacity_x"]  # fmt: skip
    return frame[columns]
