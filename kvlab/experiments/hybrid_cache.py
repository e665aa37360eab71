"""What KV cache groups buy and where their prefix cache misses (kvlab.cache.hybrid).

    held = kv_held(model, {"all full": full, "5:1, window 32": hybrid}, prompt_tokens=512)
    hits = chat_hits(model, {"all full": full, "5:1, window 32": hybrid}, sessions=[4, 8])

`kv_held` gives every system the same KV budget and as many long requests as it can
take: how many run at once, and how many tokens of context they hold. A sliding group
holds only its window's blocks, so a hybrid model's budget holds more.

`chat_hits` serves multi-turn chats (kvlab.multiturn: each turn's prompt is the whole
conversation so far) in rounds over a budget that cannot keep every conversation, and
counts what later turns hit. A hit must be served by every group: a sliding group needs
the blocks its window reaches back from the hit, and the blocks it dropped early in a
turn are the oldest in the LRU, evicted first. A retention interval keeps only the
blocks a hit at its multiples reads (EngineConfig.prefix_cache_retention_interval).
The same rows over several block sizes show the other trap: a hit is whole blocks, so
where a hybrid model's groups force a large block (vLLM: the least common multiple of
the groups' block sizes), prompts shorter than a block never hit.
"""

from __future__ import annotations

import pandas as pd

from kvlab.build import Engine
from kvlab.config import EngineConfig, SamplingParams
from kvlab.model.loading import LoadedModel
from kvlab.multiturn import chat_sessions, run_sessions
from kvlab.texts import heldout


def kv_held(
    model: LoadedModel,
    configs: dict[str, EngineConfig],
    prompt_tokens: int = 512,
    requests: int = 16,
    max_new_tokens: int = 8,
) -> pd.DataFrame:
    """One row per system: `requests` prompts of `prompt_tokens` held-out tokens each, all
    submitted at once -> most_running, most_context_tokens (context held at once),
    preemptions, kv_blocks (the pool) and kv_bytes (the budget)."""
    ids = model.tokenizer.encode(heldout())
    if len(ids) < prompt_tokens + requests:
        raise ValueError(f"prompt_tokens={prompt_tokens}: the held-out text is shorter")
    prompts = [ids[i : i + prompt_tokens] for i in range(requests)]  # distinct: no sharing
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    rows = []
    for name, config in configs.items():
        engine = Engine(model, config)
        seen = {"running": 0, "context": 0}

        def watch(finished, engine=engine, seen=seen):
            running = engine.scheduler.running
            seen["running"] = max(seen["running"], len(running))
            seen["context"] = max(seen["context"], sum(s.num_computed for s in running))

        engine.observers.subscribe("after_step", watch)
        outputs = engine.generate(prompts, params)
        rows.append({
            "system": name,
            "most_running": seen["running"],
            "most_context_tokens": seen["context"],
            "preemptions": sum(out.metrics.preemptions for out in outputs),
            "kv_blocks": engine.cache.num_blocks,
            "kv_bytes": engine.cache.memory().budget_bytes,
        })  # fmt: skip
        engine.close()
    return pd.DataFrame(rows)


def chat_hits(
    model: LoadedModel,
    configs: dict[str, EngineConfig],
    sessions: list[int],
    turns: int = 3,
    max_new_tokens: int = 16,
    concurrency: int = 2,
    max_doc_chars: int = 2500,
) -> pd.DataFrame:
    """One row per (system, sessions): later turns' prompt tokens that hit (hit_pct), how
    many later turns hit nothing (zero_hit_turns of later_turns), and the window blocks
    cached at the end (window_cached_blocks)."""
    rows = []
    for n in sessions:
        chats = chat_sessions(n, turns, max_doc_chars=max_doc_chars)
        for name, config in configs.items():
            engine = Engine(model, config)
            served = run_sessions(engine, chats, max_new_tokens, concurrency)
            later = [t for t in served if t.turn > 0]
            prompt = sum(t.prompt_tokens for t in later)
            rows.append({
                "system": name,
                "sessions": n,
                "later_turns": len(later),
                "hit_pct": 100 * sum(t.hit_tokens for t in later) / prompt,
                "zero_hit_turns": sum(t.hit_tokens == 0 for t in later),
                "window_cached_blocks": _window_cached(engine.cache),
            })  # fmt: skip
            engine.close()
    return pd.DataFrame(rows)


def _window_cached(cache) -> int:
    """Cached blocks in the sliding groups' indexes (0 for a cache without groups)."""
    if cache.groups is None or cache.index is None:
        return 0
    sliding = [part for part in cache.parts if part.group.window is not None]
    return sum(block in cache.allocator.cached for part in sliding for block in part.index.key_of)
