"""`/metrics`: Prometheus series with vLLM's names, labels, buckets and meanings.

So that vLLM's Grafana board and tooling read kvlab unchanged, every series is named as
`vllm serve` 0.32 names it (checked against a saved /metrics page of it), carries the
labels `model_name` and `engine="0"`, and counts what vLLM counts:

    vllm:num_requests_running        sequences in the running queue (n > 1: each sample)
    vllm:num_requests_waiting        requests queued, preempted or swapped out
    vllm:kv_cache_usage_perc         blocks referenced by a request / all blocks (cached
                                     blocks of finished requests are reusable: not used)
    vllm:prefix_cache_queries        prompt tokens looked up at first admission
    vllm:prefix_cache_hits           of those, tokens served from the prefix cache
    vllm:prompt_tokens               prompt tokens of requests that produced a first token
    vllm:generation_tokens           tokens generated (every sample)
    vllm:num_preemptions             times a running request lost its KV blocks
    vllm:request_success             finished requests by finished_reason (stop, length,
                                     abort: the client went away)
    vllm:time_to_first_token_seconds arrival to first token, per request
    vllm:inter_token_latency_seconds gap between consecutive tokens of a sample
    vllm:e2e_request_latency_seconds arrival to the last token, per request

plus vLLM's per-request histograms (prompt and generation tokens, queue time, time per
output token, preemptions, n, max_tokens), tokens per step, `vllm:cache_config_info`, and
three kvlab series vLLM does not have (cached and free blocks, swapped requests), and
per-tenant series under a `tenant` label (kvlab.serve.tenant_metrics).

Everything is updated from the engine loop thread; prometheus_client is thread-safe, so
the HTTP thread renders the page at any time.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from kvlab.engine.capacity import kv_capacity
from kvlab.serve.tenant_metrics import TenantMetrics

# vLLM 0.32's buckets, read from its /metrics page.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0]
TTFT_BUCKETS += [2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0]
ITL_BUCKETS += [2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0]
REQUEST_BUCKETS += [50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
STEP_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
PREEMPTION_BUCKETS = [1, 2, 3, 4, 5, 10, 20]
N_BUCKETS = [1, 2, 5, 10, 20]
LABELS = ("model_name", "engine")
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")


def token_buckets(max_model_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len (vLLM's 1-2-5 series)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


# attribute -> (series name, help text: vLLM's own where the series is vLLM's)
GAUGES = {
    "running": ("vllm:num_requests_running", "Number of requests in model execution batches."),
    "waiting": ("vllm:num_requests_waiting", "Number of requests waiting to be processed."),
    "kv_usage": ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
    "cached_blocks": (
        "kvlab:kv_cache_cached_blocks",
        "Blocks of finished requests kept for prefix reuse (evictable, so also free).",
    ),
    # vLLM's meaning of free (BlockPool.get_num_free_blocks): its free queue holds the cached
    # blocks no request references (evicted when taken), so they count; so does engine.stats()
    "free_blocks": (
        "kvlab:kv_cache_free_blocks",
        "Blocks an allocation can take: never used, or cached with no reference (evictable).",
    ),
    "swapped": ("kvlab:num_requests_swapped", "Requests whose KV sits in host memory."),
}
COUNTERS = {
    "queries": (
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
    ),
    "hits": ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
    "preemptions": ("vllm:num_preemptions", "Cumulative number of preemption from the engine."),
    "prompt_tokens": ("vllm:prompt_tokens", "Number of prefill tokens processed."),
    "cached_tokens": (
        "vllm:prompt_tokens_cached",
        "Number of cached prompt tokens (local + external).",
    ),
    "generation_tokens": ("vllm:generation_tokens", "Number of generation tokens processed."),
}
# attribute -> (series name, help text, buckets; "lengths": 1-2-5 up to max_model_len)
HISTOGRAMS = {
    "ttft": (
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        TTFT_BUCKETS,
    ),
    "itl": (
        "vllm:inter_token_latency_seconds",
        "Histogram of inter-token latency in seconds.",
        ITL_BUCKETS,
    ),
    "tpot": (
        "vllm:request_time_per_output_token_seconds",
        "Histogram of time_per_output_token_seconds per request.",
        ITL_BUCKETS,
    ),
    "e2e": (
        "vllm:e2e_request_latency_seconds",
        "Histogram of e2e request latency in seconds.",
        REQUEST_BUCKETS,
    ),
    "queue_time": (
        "vllm:request_queue_time_seconds",
        "Histogram of time spent in WAITING phase for request.",
        REQUEST_BUCKETS,
    ),
    "prompt_len": ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", "lengths"),
    "output_len": (
        "vllm:request_generation_tokens",
        "Number of generation tokens processed.",
        "lengths",
    ),
    "request_preemptions": (
        "vllm:request_num_preemptions",
        "Histogram of the number of times a request was preempted.",
        PREEMPTION_BUCKETS,
    ),
    "step_tokens": (
        "vllm:iteration_tokens_total",
        "Histogram of number of tokens per engine_step.",
        STEP_TOKEN_BUCKETS,
    ),
    "params_n": ("vllm:request_params_n", "Histogram of the n request parameter.", N_BUCKETS),
    "params_max_tokens": (
        "vllm:request_params_max_tokens",
        "Histogram of the max_tokens request parameter.",
        "lengths",
    ),
}


class ServeMetrics:
    """vLLM's metrics for one engine; `render()` is the /metrics page."""

    def __init__(self, model_name: str, engine):
        self.registry = registry = CollectorRegistry()
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        GCCollector(registry=registry)
        labels = (model_name, "0")
        for attr, (name, doc) in GAUGES.items():
            setattr(self, attr, Gauge(name, doc, LABELS, registry=registry).labels(*labels))
        for attr, (name, doc) in COUNTERS.items():
            setattr(self, attr, Counter(name, doc, LABELS, registry=registry).labels(*labels))
        lengths = token_buckets(engine.max_model_len)
        for attr, (name, doc, buckets) in HISTOGRAMS.items():
            buckets = lengths if buckets == "lengths" else buckets
            series = Histogram(name, doc, LABELS, buckets=buckets, registry=registry)
            setattr(self, attr, series.labels(*labels))
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            (*LABELS, "finished_reason"),
            registry=registry,
        )
        self.success = {r: success.labels(*labels, r) for r in FINISHED_REASONS}
        self.tenants = TenantMetrics(registry, labels)
        self._cache_info(engine, registry)
        self._preemptions_seen = engine.scheduler.preemptions
        self._last_step = None

    def _cache_info(self, engine, registry) -> None:
        config, capacity = engine.config, kv_capacity(engine)
        info = {
            "block_size": capacity.block_size,
            "num_gpu_blocks": capacity.num_blocks,
            "kv_cache_size_tokens": capacity.tokens,
            "kv_cache_memory_bytes": capacity.budget_bytes,
            "kv_cache_max_concurrency": round(capacity.max_concurrency, 3),
            "enable_prefix_caching": config.prefix_caching is not None,
            "cache_dtype": config.kv_codec or "auto",
            "kvlab_cache": config.cache,
            "kvlab_prefix_caching": config.prefix_caching,
            "kvlab_admission": type(engine.cache).admission_of(config),
            "kvlab_preemption": config.preemption,
        }
        gauge = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            ["engine", *info],
            registry=registry,
        )
        gauge.labels("0", *map(str, info.values())).set(1)

    # --- events from the engine loop ---------------------------------------------
    def request_added(self, params, tenant: str | None = None) -> None:
        self.params_n.observe(params.n)
        self.params_max_tokens.observe(params.max_new_tokens)

    def request_admitted(self, seq, step_start: float, tenant: str | None = None) -> None:
        """First admission: the prefix-cache lookup and the time spent queued."""
        self.queries.inc(len(seq.prompt_ids))
        self.hits.inc(seq.prefix_hit_tokens)
        self.tenants.add(tenant, "prefix_cache_queries", len(seq.prompt_ids))
        self.tenants.add(tenant, "prefix_cache_hits", seq.prefix_hit_tokens)
        self.cached_tokens.inc(seq.prefix_hit_tokens)
        self.queue_time.observe(max(0.0, step_start - seq.arrival_s))

    def first_token(self, seq, tenant: str | None = None) -> None:
        """The request's first token: its TTFT, and its prompt counts as processed."""
        self.ttft.observe(seq.first_token_s - seq.arrival_s)
        self.prompt_tokens.inc(len(seq.prompt_ids))
        self.tenants.add(tenant, "prompt_tokens", len(seq.prompt_ids))

    def tokens(self, count: int, gap_s: float | None, tenant: str | None = None) -> None:
        """`count` new tokens of one sample, `gap_s` after its previous one (None: its
        first token; one token per step, so count is 1 after the first)."""
        self.generation_tokens.inc(count)
        self.tenants.add(tenant, "generation_tokens", count)
        if gap_s is not None:
            for _ in range(count):
                self.itl.observe(gap_s)

    def request_finished(self, seq, finishes, completion, preemptions, now, tenant=None) -> None:
        self.success[finishes[0]].inc()
        self.tenants.outcome(tenant, finishes[0])
        self.e2e.observe(now - seq.arrival_s)
        self.prompt_len.observe(len(seq.prompt_ids))
        self.output_len.observe(completion)
        self.request_preemptions.observe(preemptions)
        first = seq.first_token_s if seq.first_token_s is not None else now
        per_sample = completion / max(1, len(finishes))
        if per_sample > 1:
            self.tpot.observe((now - first) / (per_sample - 1))

    def request_aborted(self, reason: str, tenant: str | None = None) -> None:
        reason = reason if reason in self.success else "abort"
        self.success[reason].inc()
        self.tenants.outcome(tenant, reason)

    def step_done(self, engine) -> None:
        records = engine.telemetry.records
        if records and records[-1].step != self._last_step:
            self._last_step = records[-1].step
            self.step_tokens.observe(records[-1].tokens)
        self.refresh(engine)

    def refresh(self, engine) -> None:
        """Gauges from the engine's state now; preemptions since the last refresh."""
        scheduler, cache = engine.scheduler, engine.cache
        self.running.set(len(scheduler.running))
        self.waiting.set(len(scheduler.waiting) + len(scheduler.swapped))
        self.swapped.set(len(scheduler.swapped))
        self.kv_usage.set((cache.num_blocks - cache.num_available) / cache.num_blocks)
        self.cached_blocks.set(cache.allocator.num_cached if cache.shares_prefixes else 0)
        self.free_blocks.set(cache.num_available)
        self.preemptions.inc(scheduler.preemptions - self._preemptions_seen)
        self._preemptions_seen = scheduler.preemptions

    def render(self) -> tuple[bytes, str]:
        """The /metrics page and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
