"""What a retention policy costs in recall and perplexity, and what it saves in KV memory.

- `needle_set`: needle-in-a-haystack prompts made of kvlab's own documents
  (kvlab.texts.documents): a one-sentence fact ("The magic number of <city> is <n>.")
  placed at a given depth of a context of a given length, then a question about it. An
  answer counts as recalled when it contains the number.
- `recall`: the engine (paged cache, chunked prefill, greedy) answering the needle set
  under one config; per prompt, whether it recalled the number and the most KV the
  sequence held between steps.
- `score`: the held-out text (kvlab.texts.heldout) teacher-forced through a real paged
  cache with the config's retention policy, chunk by chunk as a chunked prefill: the
  policy drops blocks between chunks, so later chunks only see what it kept. Per token
  the negative log-likelihood, per chunk the blocks held.
- `budget_config`: the config of a policy at a budget of KV tokens (10 / 25 / 50 % of a
  context), split as each policy's parameters need.

All figures are measured here, on whatever machine runs them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import pandas as pd
import torch
import torch.nn.functional as F

from kvlab import texts
from kvlab.build import Engine
from kvlab.cache import make_cache
from kvlab.cache.retention import DROPPED
from kvlab.config import EngineConfig, SamplingParams
from kvlab.integrity import require
from kvlab.model.loading import LoadedModel
from kvlab.model.metadata import build_attention_metadata
from kvlab.model.runner import ModelRunner
from kvlab.sequence import Sequence
from kvlab.units import round_up

CITIES = ("Aldervale", "Brightwater", "Corran", "Dunmere", "Eastholm", "Fenwick", "Glenport",
          "Harrowgate", "Ivybridge", "Kestrel Bay", "Larkspur", "Millbrook")  # fmt: skip
QUESTION = "What is the magic number of {city}? Answer with the number only."
POLICIES = ("window", "sinks", "h2o")  # the non-full policies, in plotting order


@dataclass(frozen=True)
class Needle:
    prompt: str  # haystack with the fact inside, then the question (chat template added later)
    answer: str  # the number, as digits
    context_tokens: int  # haystack tokens (without the fact and question)
    depth: float  # where the fact sits, as a fraction of the haystack


def haystack_ids(tokenizer) -> list[int]:
    """Token ids of every document, one after the other (~12.5k tokens)."""
    return list(tokenizer.encode("\n\n".join(texts.documents().values())))


def needle_set(tokenizer, lengths: list[int], depths: list[float], seed: int = 0) -> list[Needle]:
    """One needle per (length, depth): a fact inserted at a sentence boundary near `depth`
    of the first `length` haystack tokens (a different city and number for each)."""
    ids, rng = haystack_ids(tokenizer), random.Random(seed)
    if max(lengths) > len(ids):
        raise ValueError(f"lengths={lengths}: the haystack has only {len(ids)} tokens")
    needles = []
    for length in lengths:
        for depth in depths:
            city, number = rng.choice(CITIES), str(rng.randrange(1000, 10000))
            text = tokenizer.decode(ids[:length])
            cut = text.find(". ", int(depth * len(text)))
            cut = len(text) if cut < 0 else cut + 2
            fact = f"The magic number of {city} is {number}. "
            prompt = f"{text[:cut]}{fact}{text[cut:]}\n\n{QUESTION.format(city=city)}"
            needles.append(Needle(prompt, number, length, depth))
    return needles


def budget_config(base: EngineConfig, policy: str, budget: int) -> EngineConfig:
    """`base` with `policy` keeping about `budget` tokens: window = budget; sinks = one
    block of sinks + the rest as window; h2o = half heavy hitters, half window."""
    bs = base.block_size
    budget = max(round_up(budget, bs), 2 * bs)
    if policy == "window":
        return replace(base, retention="window", retention_window=budget)
    if policy == "sinks":
        return replace(base, retention="sinks", retention_sinks=bs, retention_window=budget - bs)
    if policy == "h2o":
        half = round_up(budget // 2, bs)
        return replace(base, retention="h2o", retention_heavy=half, retention_window=budget - half)
    if policy == "full":
        return replace(base, retention="full")
    raise ValueError(f"policy={policy!r} is unknown; choose one of {('full', *POLICIES)}")


def recall(
    model: LoadedModel, needles: list[Needle], config: EngineConfig, max_new_tokens: int = 20
) -> pd.DataFrame:
    """Answer every needle, one at a time, on a fresh engine with `config`; one row each:
    recalled (the number is in the answer), answer text, peak KV held between steps."""
    engine = Engine(model, config)
    per_token = engine.cache.pool.bytes_per_token
    rows = []
    for needle in needles:
        before = len(engine.telemetry.records)
        [out] = engine.generate([needle.prompt], SamplingParams(max_new_tokens=max_new_tokens))
        used = [r.blocks_used for r in engine.telemetry.records[before:]]
        rows.append(
            {
                "context_tokens": needle.context_tokens,
                "depth": needle.depth,
                "prompt_tokens": len(out.prompt_token_ids),
                "recalled": needle.answer in out.text,
                "answer": out.text,
                "peak_kv_bytes": max(used) * engine.cache.block_size * per_token,
                "full_kv_bytes": (len(out.prompt_token_ids) + len(out.token_ids)) * per_token,
            }
        )
    return pd.DataFrame(rows)


@dataclass
class Scored:
    nll: torch.Tensor  # (n,) float64: -log p(ids[i + 1] | kept context) per fed token
    held_blocks: list[int]  # blocks the sequence held after each chunk (after retention)
    fed_tokens: list[int]  # tokens fed so far, after each chunk
    logits: torch.Tensor | None  # (n, vocab) when asked for (small inputs only)


@torch.inference_mode()
def score(
    runner: ModelRunner,
    ids: list[int],
    config: EngineConfig,
    chunk: int = 64,
    keep_logits: bool = False,
) -> Scored:
    """Teacher-force ids[:-1] through a paged cache built from `config` (its retention
    policy drops blocks between chunks, as in the engine) and score each next token."""
    n = len(ids) - 1
    if n < 1:
        raise ValueError(f"need at least 2 token ids to score, got {len(ids)}")
    slots = round_up(n, config.block_size) + config.block_size
    config = replace(config, cache="paged", kv_budget_tokens=slots, kv_budget_bytes=None)
    cache = make_cache(config, runner.kv_spec, runner.dtype, runner.device, slots)
    seq = Sequence(0, list(ids[:-1]), SamplingParams(max_new_tokens=1))
    require(cache.allocate_slots(seq, chunk, alone=True) is not None, "the pool holds the text")
    attention = runner.attention_fn
    if cache.retention.observes_attention:
        from kvlab.model.scored_attention import ScoredAttention

        runner.use_attention(ScoredAttention(attention, cache.retention.scores, cache.block_size))
    tokens = torch.tensor(ids, dtype=torch.long, device=runner.device)
    nll, held, fed, kept_logits = [], [], [], []
    try:
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            cache.ensure_capacity(seq, end)
            table = cache.block_table(seq)
            meta = build_attention_metadata(
                [start], [end - start], [table], cache.block_size, runner.device
            )
            logits = runner.forward(tokens[start:end], meta, cache.pool, all_logits=True)
            logp = F.log_softmax(logits.double(), -1)
            nll.append(-logp.gather(1, tokens[start + 1 : end + 1, None])[:, 0].cpu())
            if keep_logits:
                kept_logits.append(logits.cpu())
            seq.num_computed = end
            cache.retain(seq)
            held.append(cache.allocator.num_used)
            fed.append(end)
        cache.check_integrity()
    finally:
        runner.use_attention(attention)
        cache.free(seq)
    return Scored(torch.cat(nll), held, fed, torch.cat(kept_logits) if keep_logits else None)


def perplexity_table(
    runner: ModelRunner, ids: list[int], configs: dict[str, EngineConfig], chunk: int = 64
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Per named config: perplexity of ids and the peak blocks held; and the memory trace
    (tokens fed -> KV bytes held, one row per chunk and config)."""
    rows, trace = [], []
    for name, config in configs.items():
        scored = score(runner, ids, config, chunk)
        per_block = config.block_size * _bytes_per_token(runner, config)
        rows.append(
            {
                "policy": name,
                "ppl": float(scored.nll.mean().exp()),
                "peak_kv_bytes": max(scored.held_blocks) * per_block,
                "final_kv_bytes": scored.held_blocks[-1] * per_block,
            }
        )
        trace += [
            {"policy": name, "tokens": fed, "kv_bytes": blocks * per_block}
            for fed, blocks in zip(scored.fed_tokens, scored.held_blocks)
        ]
    frame = pd.DataFrame(rows)
    frame["ppl_vs_full_pct"] = 100 * (frame["ppl"] / frame["ppl"].iloc[0] - 1)
    return frame, pd.DataFrame(trace)


def _bytes_per_token(runner: ModelRunner, config: EngineConfig) -> int:
    from kvlab.cache.codecs import CODECS

    return CODECS[config.kv_codec].token_bytes(runner.kv_spec, runner.dtype)


def recall_frontier(
    model: LoadedModel,
    needles: list[Needle],
    base: EngineConfig,
    fractions: tuple[float, ...] = (0.1, 0.25, 0.5),
    policies: tuple[str, ...] = POLICIES,
    baseline: pd.DataFrame | None = None,
    max_new_tokens: int = 20,
) -> pd.DataFrame:
    """Recall of every policy at each budget (a fraction of each needle's haystack), plus
    full retention (`baseline`: `recall(model, needles, base, max_new_tokens)` if already
    measured); one row per policy, budget and needle."""
    if baseline is None:
        baseline = recall(model, needles, base, max_new_tokens)
    frames = [baseline.assign(policy="full", budget=1.0)]
    for fraction in fractions:
        for policy in policies:
            for length in sorted({n.context_tokens for n in needles}):
                group = [n for n in needles if n.context_tokens == length]
                config = budget_config(base, policy, int(fraction * length))
                rows = recall(model, group, config, max_new_tokens)
                frames.append(rows.assign(policy=policy, budget=fraction))
    frame = pd.concat(frames, ignore_index=True)
    frame["kv_kept_frac"] = frame["peak_kv_bytes"] / frame["full_kv_bytes"]
    return frame


def table_trace(
    model: LoadedModel, prompt: str | list[int], config: EngineConfig, max_new_tokens: int = 32
) -> pd.DataFrame:
    """One request stepped through an engine with `config`: after every step, each logical
    block of its table as "kept" (with its physical id) or "dropped" (for block maps)."""
    engine = Engine(model, config)
    request_id = engine.add_request(prompt, SamplingParams(max_new_tokens, ignore_eos=True))
    [seq] = [s for s in engine.scheduler.waiting if s.request_id == request_id]
    rows, step = [], 0
    while engine.has_unfinished():
        engine.step()
        step += 1
        if seq.request_id not in engine.cache.tables:
            break  # finished: its blocks are gone
        for i, block in enumerate(engine.cache.block_table(seq)):
            state = "dropped" if block == DROPPED else "kept"
            rows.append(
                {
                    "step": step,
                    "tokens": seq.num_computed,
                    "logical": i,
                    "physical": block,
                    "state": state,
                }
            )
    return pd.DataFrame(rows)
