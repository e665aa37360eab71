"""Prefix sharing measured live on the real model (notebook 03's experiments).

- `serve` / `serve_sharing`: run requests so that later ones can hit earlier ones' cached
  prefix (one after another, or one first and the rest while it decodes).
- `index_hits`: prompt tokens each prefix index serves from the cache, per block size.
- `measure_sharing`, `sharing_table`: prompt tokens computed, hit rate and peak KV blocks as
  more requests share one preamble, with and without sharing; `index_savings`: each
  prefix index against no sharing, outputs compared.
- `warm_vs_cold`: time to first token of a request whose prefix is cached, and of one
  whose prefix is not.
- `fork_vs_separate`: n > 1 sampling with copy-on-write forks against n separate requests.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import replace

import pandas as pd

from kvlab import texts
from kvlab.build import Engine
from kvlab.config import EngineConfig, SamplingParams
from kvlab.engine.outputs import RequestOutput
from kvlab.engine.requests import Prompt
from kvlab.model.loading import LoadedModel
from kvlab.units import MiB, round_up

MODES = {"with sharing": "hash", "without sharing": None}


def preamble_prompts(n: int) -> list[str]:
    """n doc-QA style prompts: the shared ~300-token preamble, then a short numbered question
    (questions cycle past 48, the number keeps every prompt distinct)."""
    questions = texts.questions()
    return [
        f"{texts.preamble()}\n\nQuestion {i + 1}: {questions[i % len(questions)]}" for i in range(n)
    ]


def paged_config(
    block_size: int, max_model_len: int, sequences: int, prefix_caching: str | None = None
) -> EngineConfig:
    """A paged engine's config whose KV budget holds `sequences` sequences of
    max_model_len tokens (in whole blocks), so these experiments never preempt."""
    return EngineConfig(
        cache="paged",
        block_size=block_size,
        prefix_caching=prefix_caching,
        max_model_len=max_model_len,
        kv_budget_tokens=sequences * round_up(max_model_len, block_size),
    )


def common_prefix(a: Seq[int], b: Seq[int]) -> int:
    """Length of the longest common prefix of two token-id lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def drain(engine: Engine) -> None:
    """Step the engine until no request is waiting or running."""
    while engine.has_unfinished():
        engine.step()


def output_of(engine: Engine, request_id: int) -> RequestOutput:
    """The finished output of one request."""
    return next(o for o in engine.finished if o.request_id == request_id)


def serve(
    engine: Engine,
    prompt: Prompt,
    params: SamplingParams | None = None,
    *,
    salt: str | None = None,
    chat: bool | None = None,
) -> RequestOutput:
    """Serve one request to completion (anything already queued runs too)."""
    request_id = engine.add_request(prompt, params, salt=salt, chat=chat)
    drain(engine)
    return output_of(engine, request_id)


def serve_sharing(
    engine: Engine, prompts: Seq[Prompt], params: SamplingParams
) -> list[RequestOutput]:
    """The first prompt arrives alone and is prefilled; the others arrive while it decodes.

    One request warms the cache, the rest reuse it. (Requests admitted in the same step
    share too: a prompt's full blocks are published when its step is scheduled, as in
    vLLM V1; only a radix hit's partial-block copy needs its source computed in an earlier
    step.) Deterministic (no clocks involved).
    """
    ids = [engine.add_request(prompts[0], params)]
    engine.step()
    ids += [engine.add_request(p, params) for p in prompts[1:]]
    drain(engine)
    return [output_of(engine, i) for i in ids]


def index_hits(
    model: LoadedModel,
    prompts: Seq[Prompt],
    block_sizes: Seq[int] = (16, 64),
    kinds: Seq[str] = ("hash", "radix"),
    max_new_tokens: int = 2,
    max_model_len: int = 1024,
) -> pd.DataFrame:
    """Serve `prompts` one after another under each prefix index and block size; one row
    per request: its prompt tokens, the longest prefix it shares with an earlier prompt,
    and the prompt tokens each index served from the cache ("hash/16", "radix/64", ...)."""
    frame = pd.DataFrame(index=pd.RangeIndex(len(prompts), name="request"))
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    for block_size in block_sizes:
        for kind in kinds:
            engine = Engine(model, paged_config(block_size, max_model_len, 4, kind))
            if "prompt tokens" not in frame:
                ids = [engine.encode(p) for p in prompts]
                frame["prompt tokens"] = [len(i) for i in ids]
                frame["shared with earlier"] = [
                    max((common_prefix(ids[j], ids[i]) for j in range(i)), default=0)
                    for i in range(len(ids))
                ]
            hits = [serve(engine, p, params).metrics.prefix_hit_tokens for p in prompts]
            frame[f"{kind}/{block_size}"] = hits
    return frame


def measure_sharing(
    model: LoadedModel,
    prompts: Seq[Prompt],
    prefix_caching: str | None,
    block_size: int = 16,
    max_new_tokens: int = 4,
    max_model_len: int = 1024,
) -> tuple[dict[str, float], list[RequestOutput]]:
    """Serve `prompts` (first alone, the rest while it decodes) and count what it cost:
    prompt tokens, tokens computed, hit rate and peak blocks / MiB of KV held. Returns
    that row and the run's outputs."""
    engine = Engine(model, paged_config(block_size, max_model_len, len(prompts), prefix_caching))
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    outputs = serve_sharing(engine, prompts, params)
    stats = engine.stats()
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    hits = sum(o.metrics.prefix_hit_tokens for o in outputs)
    row = {
        "requests": len(prompts),
        "block size": block_size,
        "prompt tokens": prompt_tokens,
        "tokens computed": prompt_tokens - hits,
        "hit rate %": round(100 * hits / prompt_tokens, 1),
        "peak blocks": int(stats["blocks_used"].max()),
        "peak KV MiB": round(float(stats["reserved_bytes"].max()) / MiB, 1),
    }
    return row, outputs


def index_savings(
    model: LoadedModel,
    prompts: Seq[Prompt],
    kinds: Seq[str] = ("hash", "radix"),
    block_size: int = 16,
    max_new_tokens: int = 4,
    max_model_len: int = 1024,
) -> dict[str | None, dict[str, float]]:
    """`measure_sharing` without sharing (key None) and under each prefix index in `kinds`.

    Each index's row adds "computed reduction" (1 - its tokens computed / the tokens
    computed without sharing) and "identical outputs" (its greedy tokens equal those of
    the run without sharing, request by request).
    """
    args = (block_size, max_new_tokens, max_model_len)
    base, expected = measure_sharing(model, prompts, None, *args)
    rows: dict[str | None, dict[str, float]] = {None: base}
    for kind in kinds:
        row, outputs = measure_sharing(model, prompts, kind, *args)
        row["computed reduction"] = round(1 - row["tokens computed"] / base["tokens computed"], 4)
        row["identical outputs"] = [o.token_ids for o in outputs] == [o.token_ids for o in expected]
        rows[kind] = row
    return rows


def warm_vs_cold(
    model: LoadedModel,
    prompts: Seq[Prompt],
    prefix_caching: str = "hash",
    block_size: int = 16,
    max_model_len: int = 1024,
) -> dict[str, float]:
    """Time to first token of `prompts[0]` on an empty prefix cache (cold), then of
    `prompts[1]`, which shares its prefix (warm); one request at a time, one token each.

    An untimed request on a separate engine goes first, so the cold one pays for the
    empty cache only, not for the model's first call. Seconds (this machine's), and the
    warm request's prefix_hit_tokens (deterministic).
    """
    config = paged_config(block_size, max_model_len, 2, prefix_caching)
    params = SamplingParams(max_new_tokens=1)
    serve(Engine(model, config), prompts[0], params)  # warm-up
    engine = Engine(model, config)
    cold, warm = (serve(engine, p, params).metrics for p in prompts[:2])
    return {
        "cold_s": round(cold.ttft_s, 4),
        "warm_s": round(warm.ttft_s, 4),
        "warm_over_cold": round(warm.ttft_s / cold.ttft_s, 3),
        "warm_hit_tokens": warm.prefix_hit_tokens,
    }


def sharing_table(
    model: LoadedModel,
    prompts: Seq[Prompt],
    counts: Seq[int],
    block_size: int = 16,
    max_new_tokens: int = 4,
) -> pd.DataFrame:
    """measure_sharing with and without sharing for the first n prompts, n in `counts`."""
    rows = [
        {"mode": mode, **measure_sharing(model, prompts[:n], kind, block_size, max_new_tokens)[0]}
        for n in counts
        for mode, kind in MODES.items()
    ]
    return pd.DataFrame(rows)


def fork_vs_separate(
    model: LoadedModel,
    prompt: Prompt,
    params: SamplingParams,
    block_size: int = 16,
    max_model_len: int = 1024,
    batch_invariant: bool = False,
) -> tuple[dict[str, dict[str, float]], dict[str, pd.DataFrame]]:
    """`params.n` samples of one prompt two ways, prefix caching off in both: one request
    whose samples fork with copy-on-write, and n separate requests (seeds seed + i, which
    are the seeds the forks use). Returns a summary per way and each run's step stats.
    `batch_invariant`: EngineConfig.batch_invariant, so both ways draw from the same bits."""
    n = params.n
    config = replace(paged_config(block_size, max_model_len, n), batch_invariant=batch_invariant)
    seeds = [None if params.seed is None else params.seed + i for i in range(n)]
    runs = {
        f"n={n}, copy-on-write": [params],
        f"{n} separate requests": [replace(params, n=1, seed=seed) for seed in seeds],
    }
    summary, stats = {}, {}
    for name, param_list in runs.items():
        engine = Engine(model, config)
        outputs = engine.generate([prompt] * len(param_list), param_list)
        samples = [s for o in outputs for s in o.samples]
        stats[name] = engine.stats()
        summary[name] = {
            "samples": len(samples),
            "tokens computed": int(stats[name]["tokens"].sum()),
            "peak blocks": int(stats[name]["blocks_used"].max()),
            "peak KV MiB": round(float(stats[name]["reserved_bytes"].max()) / MiB, 1),
            "copy-on-write copies": engine.cache.copied_blocks,
            "texts": [s.text for s in samples],
        }
    return summary, stats
