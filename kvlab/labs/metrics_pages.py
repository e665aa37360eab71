"""The pages lab 8 (kvlab.labs.metrics) reads: vLLM-named /metrics pages.

- `pages(scenario)`: the pages scraped before and after a scenario's interval, rendered by
  kvlab's own server metrics (`ServeMetrics`, kvlab/serve/metrics.py) fed the events of a
  small workload on a real `PagedCache` with a hash prefix index (no model: prompts are
  admitted, computed, published and freed as the engine does). The process and Python
  series are left out and creation times fixed, so every run renders the same pages.
- `HIT_SCENARIOS`, `PREEMPTION_SCENARIOS`, `random_scenarios`: the intervals graded.
- `sample_page`, `label_page`: seeded pages of tricky lines for the parser's checks.
"""

from __future__ import annotations

import functools
import random
import re
from types import SimpleNamespace
from typing import NamedTuple

import torch

from kvlab.labs.grading import SEED_STRIDE

MODEL = "SmolLM2-135M"


class ServedRequest(NamedTuple):
    """A request the stand-in server serves: prompt and output lengths, and its fate."""

    family: int | None  # requests of one family share their first blocks; None: unique
    prompt_len: int
    output_len: int
    finished: bool = True
    preemptions: int = 0  # times it lost its blocks (counted by the scheduler)


class _Server:
    """kvlab's ServeMetrics on a stand-in engine: a real PagedCache, a scheduler's counts."""

    def __init__(self, prefix_caching: bool, num_blocks: int = 48, block_size: int = 16):
        from kvlab.cache import HashPrefixIndex, KVPool, KVSpec, PagedCache
        from kvlab.config import EngineConfig
        from kvlab.serve.metrics import ServeMetrics

        config = EngineConfig(
            cache="paged",
            prefix_caching="hash" if prefix_caching else None,
            block_size=block_size,
            max_model_len=512,
        )
        pool = KVPool(KVSpec(1, 1, 2), num_blocks * block_size, torch.float32, torch.device("cpu"))
        index = HashPrefixIndex(block_size) if prefix_caching else None
        self.cache = PagedCache(pool, block_size, 512, prefix_index=index)
        self.scheduler = SimpleNamespace(running=[], waiting=[], swapped=[], preemptions=0)
        self.engine = SimpleNamespace(
            max_model_len=512,
            config=config,
            cache=self.cache,
            scheduler=self.scheduler,
            telemetry=SimpleNamespace(records=[]),
        )
        self.metrics = ServeMetrics(MODEL, self.engine)
        self.next_id, self.clock = 0, 0.0

    def serve(self, request: ServedRequest) -> None:
        from kvlab.config import SamplingParams
        from kvlab.sequence import Sequence

        rid, self.next_id = self.next_id, self.next_id + 1
        if request.family is None:
            prompt = [(7 * rid + i) % 900 + 1000 for i in range(request.prompt_len)]
        else:
            prompt = [(13 * request.family + 5 * i) % 997 for i in range(request.prompt_len)]
        params = SamplingParams(max_new_tokens=request.output_len)
        seq = Sequence(rid, prompt, params, arrival_s=self.clock)
        self.metrics.request_added(params)
        if self.cache.allocate_slots(seq) is None:
            raise RuntimeError(f"request {rid} does not fit the page's cache")
        seq.num_computed = len(prompt)
        self.cache.publish(seq)
        self.metrics.request_admitted(seq, self.clock + 0.01)
        seq.first_token_s = self.clock + 0.05
        self.metrics.first_token(seq)
        for i in range(request.output_len):
            seq.output_ids.append(i % 50)
            self.cache.ensure_capacity(seq, seq.num_tokens)
            seq.num_computed = seq.num_tokens
            self.metrics.tokens(1, None if i == 0 else 0.02)
        self.scheduler.preemptions += request.preemptions
        self.clock += 0.1
        if request.finished:
            self.cache.free(seq)
            done = self.clock + 0.02 * request.output_len
            self.metrics.request_finished(
                seq, ["length"], request.output_len, request.preemptions, done
            )
        else:
            self.scheduler.running.append(seq)
        self.metrics.refresh(self.engine)

    def page(self) -> str:
        self.metrics.refresh(self.engine)
        text = self.metrics.render()[0].decode()
        keep = [
            line
            for line in text.splitlines()
            if not re.match(r"(# (HELP|TYPE) )?(process|python)_", line)
        ]
        page = "\n".join(keep) + "\n"
        return re.sub(
            r"^([^#\s{]+_created(\{.*\})?) \S+$", r"\1 1.7961224402e+09", page, flags=re.M
        )


class Scenario(NamedTuple):
    what: str  # the interval, in words
    prefix_caching: bool
    warmup: tuple[ServedRequest, ...]
    interval: tuple[ServedRequest, ...]


@functools.lru_cache(maxsize=256)
def pages(scenario: Scenario) -> tuple[str, str]:
    """(before, after): the /metrics pages scraped around the scenario's interval (the
    same for the same scenario: each page's *_created times are fixed)."""
    server = _Server(scenario.prefix_caching)
    for request in scenario.warmup:
        server.serve(request)
    before = server.page()
    for request in scenario.interval:
        server.serve(request)
    return before, server.page()


def example_pages() -> tuple[str, str]:
    """The pages of the notebook's "Try it" cell: a warm server, then four requests (two
    share a prompt's opening with earlier ones), one of them preempted once and running."""
    return pages(HIT_SCENARIOS[0])


R = ServedRequest
HIT_SCENARIOS = [
    Scenario(
        "4 requests, 2 of them sharing 2 blocks with earlier ones",
        True,
        (R(0, 40, 4), R(0, 40, 4), R(None, 30, 3)),
        (R(0, 40, 5), R(None, 20, 2), R(0, 36, 3, finished=False, preemptions=1), R(1, 50, 2)),
    ),
    Scenario("no requests", True, (R(0, 40, 4), R(0, 40, 4)), ()),
    Scenario(
        "3 requests with one prompt, prefix caching off",
        False,
        (R(0, 40, 4), R(0, 40, 4)),
        (R(0, 40, 2), R(0, 40, 2), R(0, 40, 2)),
    ),
    Scenario(
        "3 requests, no two sharing an opening",
        True,
        (R(0, 40, 4), R(0, 40, 4), R(0, 48, 4)),
        (R(None, 40, 2), R(None, 33, 2), R(None, 64, 2)),
    ),
    Scenario(
        "6 short requests, all with one long shared opening",
        True,
        (R(2, 70, 1),),
        tuple(R(2, 70, 1) for _ in range(6)),
    ),
]
PREEMPTION_SCENARIOS = [
    Scenario(
        "3 requests, none preempted, 2 still running",
        True,
        (R(0, 40, 2, preemptions=2),),
        (R(None, 60, 3, finished=False), R(None, 90, 3, finished=False), R(0, 40, 2)),
    ),
    Scenario(
        "4 requests: 1 preempted once and finished, 1 preempted twice and still running",
        True,
        (R(0, 40, 2),),
        (
            R(None, 40, 3, preemptions=1),
            R(None, 100, 3, finished=False, preemptions=2),
            R(0, 40, 2),
            R(None, 30, 2),
        ),
    ),
    Scenario(
        "5 requests, 3 preemptions, 3 requests still running",
        False,
        (R(None, 20, 1),),
        (
            R(None, 64, 2, finished=False, preemptions=1),
            R(None, 64, 2, finished=False, preemptions=1),
            R(None, 64, 2, finished=False),
            R(None, 20, 2, preemptions=1),
            R(None, 20, 2),
        ),
    ),
]


def random_scenarios(count: int, seed: int, base: int) -> list[Scenario]:
    rng = random.Random(base + SEED_STRIDE * seed)

    def request() -> ServedRequest:
        family = rng.choice([None, 0, 0, 1, 2])
        length = rng.randint(10, 80) if family is None else rng.choice([33, 40, 48, 64])
        return R(family, length, rng.randint(1, 4), rng.random() < 0.7, rng.choice([0, 0, 1, 2]))

    out = []
    for i in range(count):
        warm = tuple(request() for _ in range(rng.randint(0, 4)))
        interval = tuple(request() for _ in range(rng.randint(0, 5)))
        out.append(Scenario(f"random interval {i}", rng.random() < 0.8, warm, interval))
    return out


# --- pages for the parser's checks ---------------------------------------------------------
def sample_page(rng: random.Random) -> str:
    q, h = rng.randint(0, 5000), rng.randint(0, 2000)
    return f"""\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",model_name="{MODEL}"}} {rng.randint(0, 9)}.0

# HELP process_virtual_memory_bytes Virtual memory size in bytes.
# TYPE process_virtual_memory_bytes gauge
process_virtual_memory_bytes {rng.randint(1, 9)}.32411136e+09
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{{engine="0",model_name="{MODEL}"}} {q}.0
vllm:prefix_cache_queries_created{{engine="0",model_name="{MODEL}"}} 1.7961224402219715e+09
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{{engine="0",model_name="{MODEL}"}} {h} 1796122440221
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",model_name="{MODEL}"}} {rng.randint(0, 99) / 100}
"""


def label_page(rng: random.Random) -> str:
    tricky = ["a, b", "x y", 'q\\"uote', "back\\\\slash", "br}ace", "k=v", "", "line\\nbreak"]
    picks = rng.sample(tricky, 4)
    info, e2e = "vllm:cache_config_info", "vllm:e2e_request_latency_seconds"
    return f"""\
# TYPE vllm:request_success counter
vllm:request_success_total{{engine="0",finished_reason="stop",model_name="{picks[0]}"}} 3.0
vllm:request_success_total{{model_name="{picks[1]}",finished_reason="length",engine="1"}} 16.0
# TYPE vllm:cache_config_info gauge
{info}{{block_size="16",cache_dtype="{picks[2]}",enable_prefix_caching="True",engine="0"}} 1.0
# TYPE vllm:e2e_request_latency_seconds histogram
{e2e}_bucket{{engine="0",le="0.3",model_name="{picks[3]}"}} {rng.randint(0, 4)}.0
vllm:e2e_request_latency_seconds_bucket{{engine="0",le="+Inf",model_name="{picks[3]}"}} 5.0
vllm:e2e_request_latency_seconds_count{{engine="0",model_name="{picks[3]}",}} 5.0
vllm:e2e_request_latency_seconds_sum{{engine="0",model_name="{picks[3]}"}} {rng.randint(1, 90) / 10}
"""
