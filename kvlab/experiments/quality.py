"""What a KV codec costs in quality and buys in capacity, measured on the real model.

- `teacher_forced`: the held-out text (kvlab.texts.heldout) fed through the runner in
  chunks, like a chunked prefill, so every later chunk attends to K/V that earlier chunks
  wrote through the codec. Per codec: perplexity, KL(baseline || codec) of the next-token
  distributions, and how often the top-1 token matches the baseline's. The baseline (the
  model's dtype) runs in lockstep, so only one chunk's logits are ever held. The
  perplexity change comes with a 95% interval from the per-token differences of log
  loss (codec - baseline, paired on the same tokens): a change whose interval holds 0
  is noise at this much text.
- `roundtrip` / `kv_error`: the codec alone on the baseline's real K/V (write, gather).
- `stepwise_agreement` (the report's greedy_agreement): along the baseline's greedy
  answers to chat prompts, how often the codec picks the same greedy token given the
  same history; every step reads its K/V back through the codec, as decode does. All
  prompts run as one batch per codec.
- `greedy_tokens` / `agreement` (free_run_agreement): the engine (paged cache) answering
  chat prompts greedily with and without the codec; the fraction of positions where the
  tokens match. Strict: after a first difference the rest usually differs too, and a
  token one answer has and the other lacks counts as a difference.
- `capacity`: how many requests of a workload the paged cache admits at once from a
  full queue at one byte budget (worst-case reservation of prompt + max_new_tokens, first
  come first served, as the scheduler admits). It is counted, not run: no forward pass.
  kivi2's full-precision windows (per sequence, outside bytes per token) are paid for
  out of the budget first.
- `codec_report`: all of it, one row per codec, with the sample sizes behind each score.
- `attention_layouts`: bytes per token of one model's shape if its attention kept MHA's,
  GQA's or MQA's K/V heads, or one MLA latent per layer (no separate V).
"""

from __future__ import annotations

import math
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
    nlls: dict[str | None, list[torch.Tensor]] = {name: [] for name in names}  # per token
    tokens = torch.tensor(ids, dtype=torch.long, device=runner.device)
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        meta = build_attention_metadata([start], [end - start], [[0]], slots, runner.device)
        skip = max(scored_from - start, 0)  # rows of this chunk that are context only
        target = tokens[start + 1 + skip : end + 1, None]
        base = base_p = base_top = None  # the baseline's log-probs, probs and top-1, once
        for name, pool in pools.items():
            logits = runner.forward(tokens[start:end], meta, pool, all_logits=True)
            logp = F.log_softmax(logits[skip:], -1)
            if name is None:
                base, base_p, base_top = logp, logp.exp(), logp.argmax(-1)
            nll = -logp.gather(1, target)[:, 0]
            nlls[name].append(nll.double().cpu())
            totals[name] += torch.stack(
                [
                    nll.sum(),
                    (base_p * (base - logp)).sum(),
                    (logp.argmax(-1) == base_top).sum(),
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
    base_nll = torch.cat(nlls[None])
    low, high = zip(*(paired_interval(torch.cat(nlls[name]) - base_nll) for name in names))
    frame["ppl_pct_low"], frame["ppl_pct_high"] = low, high
    frame["tokens_scored"] = n - scored_from
    k, v = pools[None].k[:, :n].clone(), pools[None].v[:, :n].clone()
    return TeacherForcing(frame, k, v)


def paired_interval(diff: torch.Tensor, z: float = 1.96) -> tuple[float, float]:
    """95% interval (z standard errors) of the perplexity change in percent, from the
    per-token differences of log loss `diff` (codec - baseline on the same tokens).

    exp(mean diff) is the perplexity ratio; the standard error is diff's standard
    deviation / sqrt(n), which treats tokens as independent (roughly true of these
    differences). An interval that holds 0 means: no change this much text can see.
    """
    n = diff.numel()
    mean = float(diff.mean())
    se = float(diff.std()) / n**0.5 if n > 1 else 0.0
    return 100 * (math.exp(mean - z * se) - 1), 100 * (math.exp(mean + z * se) - 1)


def beyond_noise(frame: pd.DataFrame) -> pd.Series:
    """Per row of a teacher_forced / codec_report frame: "up", "down" when the
    perplexity change's 95% interval excludes 0, else "noise"."""
    up, down = frame["ppl_pct_low"] > 0, frame["ppl_pct_high"] < 0
    return pd.Series(
        ["up" if u else "down" if d else "noise" for u, d in zip(up, down)], index=frame.index
    )


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
    steps (every token attends to K/V read back through the codec); the baseline runs
    first on the same batch. All prompts go in one forward per codec, each in its own
    region of the pool. Unlike `agreement` of free-running answers, one near-tie costs
    one token, not the rest of the answer. Answer-weighted over all prompts.
    """
    pairs = [(list(p), list(a)) for p, a in zip(prompts, answers) if a]
    if not pairs:
        raise ValueError("no answer tokens to compare")
    fed = [p + a[:-1] for p, a in pairs]  # each fed token predicts the next
    region = _slots_for(max(map(len, fed)))
    device = runner.device
    meta = build_attention_metadata(
        [0] * len(fed), [len(f) for f in fed], [[i] for i in range(len(fed))], region, device
    )
    rows, first = [], 0  # rows of the packed batch that predict an answer token
    for (prompt, _), f in zip(pairs, fed):
        rows += range(first + len(prompt) - 1, first + len(f))
        first += len(f)
    tokens = torch.tensor([t for f in fed for t in f], dtype=torch.long, device=device)
    at = torch.tensor(rows, dtype=torch.long, device=device)
    choices = {}
    for name in [None, *named(kv_codecs)]:
        pool = KVPool(runner.kv_spec, region * len(fed), runner.dtype, device, name)
        choices[label(name)] = runner.forward(tokens, meta, pool, logits_at=at).argmax(-1)
    base = choices[BASELINE]
    return {codec: float((picked == base).double().mean()) for codec, picked in choices.items()}


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
        if engine.cache.allocate_slots(seq) is None:
            break
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


def mla_latent(head_dim: int) -> int:
    """Elements of one MLA latent per token per layer at DeepSeek-V2's ratios: a compressed
    KV of 4 x head_dim and a decoupled RoPE key of head_dim / 2 (arXiv 2405.04434, sec. 2.1;
    DeepSeek-V2/V3: 512 + 64 = 576 for head_dim 128)."""
    return 4 * head_dim + head_dim // 2


def attention_layouts(
    spec: KVSpec, num_heads: int, dtype: torch.dtype, latent: int | None = None
) -> pd.DataFrame:
    """Bytes per token of one model's KV (its layers and head_dim) under four attention
    layouts: MHA (a K and a V head per query head), GQA (spec.num_kv_heads, as the model
    ships), MQA (one K/V head for all) and MLA (one latent of `latent` elements per layer,
    default `mla_latent(head_dim)`, and no separate V: vLLM's page coefficient 1 instead
    of 2, its MLAAttentionSpec). Changing the layout means training the model so; a codec
    then multiplies the saving, as on any layout."""
    element = torch.empty((), dtype=dtype).element_size()
    latent = mla_latent(spec.head_dim) if latent is None else latent
    layouts = [
        ("MHA", f"K and V, {num_heads} heads", 2, num_heads, spec.head_dim),
        ("GQA (this model)", f"K and V, {spec.num_kv_heads} heads", 2, spec.num_kv_heads,
         spec.head_dim),
        ("MQA", "K and V, 1 head", 2, 1, spec.head_dim),
        ("MLA", f"one latent of {latent}", 1, 1, latent),
    ]  # fmt: skip
    frame = pd.DataFrame(
        [
            {"attention": name, "stored per layer": stored, "coefficient": coef,
             "elements_per_layer": coef * heads * dim,
             "bytes_per_token": coef * spec.num_layers * heads * dim * element}
            for name, stored, coef, heads, dim in layouts
        ]
    )  # fmt: skip
    frame["x_smaller_than_mha"] = frame["bytes_per_token"].iloc[0] / frame["bytes_per_token"]
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

    The sample behind each score is a column: tokens_scored (perplexity, KL, top-1; with
    ppl_pct_low / ppl_pct_high, the 95% interval of ppl_increase_pct), steps_compared
    and greedy_misses (greedy_agreement), free_run_answers (free_run_agreement).
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
    steps = sum(map(len, reference))
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
                "steps_compared": steps,
                "greedy_misses": round((1 - stepwise[label(name)]) * steps),
                "free_run_agreement": agreement(reference[:free_run], tokens[:free_run]),
                "free_run_answers": len(free),
                **kv_error(name, forcing.k, forcing.v),
                "capacity": capacity(model, name, budget_bytes, encoded),
            }
        )
    frame = forcing.frame.merge(pd.DataFrame(rows), on="codec")
    frame["capacity_x"] = frame["capacity"] / frame["capacity"].iloc[0]
    columns = ["codec", "describe", "bytes_per_token", "ppl", "ppl_increase_pct",
               "ppl_pct_low", "ppl_pct_high", "tokens_scored", "kl", "top1_agreement",
               "greedy_agreement", "steps_compared", "greedy_misses", "free_run_agreement",
               "free_run_answers", "k_max_err", "k_mean_err", "v_max_err", "v_mean_err",
               "capacity", "capacity_x"]  # fmt: skip
    return frame[columns]
