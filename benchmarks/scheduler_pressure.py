"""Issue figures for the scheduler: oversubscription, static vs continuous, chunked prefill.

    python benchmarks/scheduler_pressure.py

Prints JSON: (1) a run whose total KV demand is 4x the budget, per preemption mode:
requests completed, errors, preemptions, outputs equal to an unpressured run; (2) static vs
continuous batching throughput on mixed output lengths; (3) time per output token of
running decodes while a long prompt arrives, with and without chunked prefill.
"""

from __future__ import annotations

import json
import platform
import statistics
import time

import torch

import kvlab
from kvlab import texts


def oversubscribed(model) -> dict:
    prompts = texts.chat_prompts()[:16]
    params = kvlab.SamplingParams(max_new_tokens=32, ignore_eos=True)
    calm = kvlab.Engine(model, kvlab.EngineConfig(cache="paged", max_model_len=1024))
    expected = [o.token_ids for o in calm.generate(prompts, params)]
    demand = sum(len(o.prompt_token_ids) + 32 for o in calm.finished)
    budget = 16 * (demand // 4 // 16)
    result = {"total_demand_tokens": demand, "budget_tokens": budget}
    for mode in ("recompute", "swap"):
        engine = kvlab.Engine(
            model,
            kvlab.EngineConfig(
                cache="paged",
                max_model_len=1024,
                kv_budget_tokens=budget,
                admission="watermark",
                preemption=mode,
            ),
        )
        errors = 0
        try:
            outputs = engine.generate(prompts, params)
        except Exception:  # noqa: BLE001 - counted, not hidden
            errors, outputs = 1, []
        stats = engine.stats()
        result[mode] = {
            "completed": len(outputs),
            "errors": errors,
            "preemptions": int(stats["preemptions"].iloc[-1]),
            "swapped_bytes": int(stats["swapped_bytes"].iloc[-1]),
            "recomputed_tokens": int(stats["recomputed_tokens"].iloc[-1]),
            "identical_to_unpressured": [o.token_ids for o in outputs] == expected,
            "budget_free_at_end": engine.cache.num_available == engine.cache.num_blocks,
        }
    return result


def static_vs_continuous(model) -> dict:
    prompts = texts.chat_prompts()[:16]
    params = [
        kvlab.SamplingParams(max_new_tokens=8 if i % 2 else 96, ignore_eos=True) for i in range(16)
    ]
    result = {}
    for mode in ("static", "continuous", "static", "continuous"):  # alternating, best of 2
        engine = kvlab.Engine(
            model,
            kvlab.EngineConfig(cache="paged", max_model_len=1024, batching=mode, max_num_seqs=4),
        )
        start = time.perf_counter()
        outputs = engine.generate(prompts, params)
        tok_s = sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - start)
        result[mode] = max(result.get(mode, 0.0), round(tok_s, 2))
    result["ratio_continuous_over_static"] = round(result["continuous"] / result["static"], 3)
    return result


def decode_gaps_while_long_prompt_arrives(model, chunked: bool) -> dict:
    engine = kvlab.Engine(
        model,
        kvlab.EngineConfig(
            cache="paged",
            max_model_len=4096,
            chunked_prefill=chunked,
            schedule_order="decode-first",
            max_num_batched_tokens=256 if chunked else 4096,
        ),
    )
    short = [
        engine.add_request(p, kvlab.SamplingParams(48, ignore_eos=True))
        for p in texts.chat_prompts()[:4]
    ]
    for _ in range(4):
        engine.step()
    long_doc = texts.documents()["doc16_history_of_maps"]
    engine.add_request(f"{texts.preamble()}\n\n{long_doc}", kvlab.SamplingParams(4))
    seqs = [s for s in engine.scheduler.running if s.request_id in short]
    last = {s.request_id: time.perf_counter() for s in seqs}
    counts = {s.request_id: len(s.output_ids) for s in seqs}
    gaps = []
    while engine.has_unfinished():
        engine.step()
        now = time.perf_counter()
        for s in seqs:
            if len(s.output_ids) > counts[s.request_id] and not s.is_finished:
                gaps.append(now - last[s.request_id])
                last[s.request_id], counts[s.request_id] = now, len(s.output_ids)
    gaps.sort()
    return {
        "tpot_p50_s": round(statistics.median(gaps), 4),
        "tpot_p95_s": round(gaps[int(0.95 * (len(gaps) - 1))], 4),
        "tpot_max_s": round(gaps[-1], 4),
    }


def main() -> None:
    model = kvlab.load_model()
    result = {
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, {model.device}",
        "oversubscription_4x": oversubscribed(model),
        "static_vs_continuous": static_vs_continuous(model),
        "chunked_prefill_decode_tpot": {
            "without": decode_gaps_while_long_prompt_arrives(model, chunked=False),
            "with": decode_gaps_while_long_prompt_arrives(model, chunked=True),
        },
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
