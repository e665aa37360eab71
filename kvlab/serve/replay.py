"""Replay a kvlab workload against any OpenAI-compatible server (`kvlab serve`, `vllm
serve`, a multi-GPU vLLM deployment) and read its /metrics.

Prompts go as token ids (the local tokenizer's encoding, chat template included), so the
server sees exactly the tokens an in-process run sees; each request streams
(`/v1/completions`, greedy, `ignore_eos` unless asked otherwise) at its workload arrival
time. The client measures TTFT, the gaps between streamed chunks and end-to-end latency
per request; a poller samples the server's /metrics meanwhile (KV-cache usage, running,
waiting), and the counters' change over the run gives the prefix hit rate and
preemptions as the server counted them. Series are vLLM's names, which `kvlab serve`
shares; with several engines (data parallel) counters are summed, gauges summed too
(usage: the highest engine's).

    result = asyncio.run(replay("http://127.0.0.1:8000", "SmolLM2-135M-Instruct", requests))
    result.summary()   # {"requests", "output_tokens", "tok_s", "ttft_p50_s", ...}
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

from kvlab.workloads import Request

COUNTERS = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions")
GAUGES = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting")


def read_metrics(page: str) -> dict[str, float]:
    """The counters and gauges replay uses from a /metrics page (absent series: 0)."""
    from prometheus_client.parser import text_string_to_metric_families

    values = {name: 0.0 for name in (*COUNTERS, *GAUGES)}
    for family in text_string_to_metric_families(page):
        if family.name in COUNTERS:
            values[family.name] += sum(s.value for s in family.samples if s.name.endswith("_total"))
        elif family.name == "vllm:kv_cache_usage_perc":
            values[family.name] = max([s.value for s in family.samples], default=0.0)
        elif family.name in GAUGES:
            values[family.name] += sum(s.value for s in family.samples)
    return values


@dataclass
class RequestTiming:
    prompt_tokens: int
    output_tokens: int  # the server's usage count
    text: str
    ttft_s: float
    e2e_s: float
    cached_tokens: int | None  # usage.prompt_tokens_details.cached_tokens, if reported
    gaps_s: list[float] = field(default_factory=list)  # between streamed chunks


@dataclass
class ReplayResult:
    endpoint: str
    model: str
    requests: list[RequestTiming]
    wall_s: float
    before: dict[str, float]  # /metrics counters at the start
    after: dict[str, float]  # ... at the end
    samples: list[dict[str, float]]  # /metrics gauges while the run went on (with "t_s")

    def summary(self) -> dict:
        """One row: throughput, latency percentiles, and the server's own KV counters."""

        def pct(values: list[float], q: float) -> float | None:
            if not values:
                return None
            ranked = sorted(values)
            return round(ranked[min(len(ranked) - 1, int(q * len(ranked)))], 4)

        ttft = [r.ttft_s for r in self.requests]
        gaps = [g for r in self.requests for g in r.gaps_s]
        queries = self.after["vllm:prefix_cache_queries"] - self.before["vllm:prefix_cache_queries"]
        hits = self.after["vllm:prefix_cache_hits"] - self.before["vllm:prefix_cache_hits"]
        tokens = sum(r.output_tokens for r in self.requests)
        peak = {name: max([s[name] for s in self.samples], default=0.0) for name in GAUGES}
        return {
            "endpoint": self.endpoint,
            "requests": len(self.requests),
            "output_tokens": tokens,
            "wall_s": round(self.wall_s, 3),
            "tok_s": round(tokens / self.wall_s, 2),
            "ttft_p50_s": pct(ttft, 0.5),
            "ttft_p99_s": pct(ttft, 0.99),
            "itl_p50_s": pct(gaps, 0.5),
            "itl_p99_s": pct(gaps, 0.99),
            "e2e_p50_s": pct([r.e2e_s for r in self.requests], 0.5),
            "prefix_queries": int(queries),
            "prefix_hits": int(hits),
            "prefix_hit_rate": round(hits / queries, 4) if queries else None,
            "preemptions": int(
                self.after["vllm:num_preemptions"] - self.before["vllm:num_preemptions"]
            ),
            "peak_kv_usage": round(peak["vllm:kv_cache_usage_perc"], 4),
            "peak_running": int(peak["vllm:num_requests_running"]),
            "peak_waiting": int(peak["vllm:num_requests_waiting"]),
        }


async def _one(http, url, model, request: Request, ignore_eos: bool, t0: float):
    await asyncio.sleep(max(0.0, t0 + request.arrival_s - time.perf_counter()))
    body = {
        "model": model,
        "prompt": list(request.prompt),
        "max_tokens": request.max_new_tokens,
        "temperature": 0,
        "ignore_eos": ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    text, stamps, usage = "", [], None
    async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {(await response.aread())[:500]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            usage = event.get("usage") or usage
            pieces = [c.get("text") or "" for c in event.get("choices", [])]
            if any(pieces):
                stamps.append(time.perf_counter())
                text += "".join(pieces)
    end = time.perf_counter()
    first = stamps[0] if stamps else end
    details = (usage or {}).get("prompt_tokens_details") or {}
    return RequestTiming(
        prompt_tokens=len(request.prompt),
        output_tokens=(usage or {}).get("completion_tokens", 0),
        text=text,
        ttft_s=first - start,
        e2e_s=end - start,
        cached_tokens=details.get("cached_tokens"),
        gaps_s=[b - a for a, b in zip(stamps, stamps[1:])],
    )


async def replay(
    endpoint: str,
    model: str,
    requests: list[Request],
    ignore_eos: bool = True,
    poll_s: float = 0.5,
    timeout_s: float = 3600.0,
) -> ReplayResult:
    """Send `requests` (token-id prompts: see kvlab.workloads.encode_requests) to
    `endpoint` (a base URL, no /v1) serving `model`; see the module doc."""
    if any(isinstance(r.prompt, str) for r in requests):
        raise ValueError("replay sends token ids: encode the workload first (encode_requests)")
    url = endpoint.rstrip("/")
    limits = httpx.Limits(max_connections=len(requests) + 4)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as http:
        before = read_metrics((await http.get(f"{url}/metrics")).text)
        samples: list[dict[str, float]] = []
        t0 = time.perf_counter()

        async def poll() -> None:
            while True:
                page = (await http.get(f"{url}/metrics")).text
                samples.append({"t_s": time.perf_counter() - t0, **read_metrics(page)})
                await asyncio.sleep(poll_s)

        poller = asyncio.ensure_future(poll())
        try:
            timings = await asyncio.gather(
                *(_one(http, url, model, r, ignore_eos, t0) for r in requests)
            )
        finally:
            poller.cancel()
        wall = time.perf_counter() - t0
        after = read_metrics((await http.get(f"{url}/metrics")).text)
    return ReplayResult(url, model, list(timings), wall, before, after, samples)


def replay_workload(
    endpoint: str,
    model,
    requests: list[Request],
    served: str | None = None,
    ignore_eos: bool = True,
    poll_s: float = 0.5,
) -> ReplayResult:
    """`replay` for callers without an event loop of their own, or inside one (a notebook):
    encodes `requests` with `model`'s tokenizer (a kvlab LoadedModel, as an in-process run
    would) and runs the replay on a fresh loop in a worker thread. `served`: the model name
    the endpoint serves (default: the first at /v1/models)."""
    from concurrent.futures import ThreadPoolExecutor

    from kvlab.workloads import encode_requests

    served = served or served_model(endpoint)
    coroutine = replay(endpoint, served, encode_requests(model, requests), ignore_eos, poll_s)
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def served_model(endpoint: str) -> str:
    """The first model id the server lists at /v1/models."""
    return httpx.get(f"{endpoint.rstrip('/')}/v1/models", timeout=30).json()["data"][0]["id"]
