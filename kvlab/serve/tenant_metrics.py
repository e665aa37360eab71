"""Per-tenant series of /metrics, under a `tenant` label (kvlab's names: vLLM has none).

    kvlab:tenant_requests_total{outcome}       requests by how they ended: stop, length,
                                               abort, error; or refused: rejected (a 4xx
                                               after authentication), busy (a 429)
    kvlab:tenant_prompt_tokens_total           prompt tokens of requests with a first token
    kvlab:tenant_generation_tokens_total       tokens generated
    kvlab:tenant_prefix_cache_queries_total    prompt tokens looked up at first admission
    kvlab:tenant_prefix_cache_hits_total       of those, tokens found in the prefix cache
    kvlab:tenant_requests_running              requests holding one of the tenant's places
    kvlab:tenant_requests_queued               requests waiting for one (kvlab.serve.gate)

vLLM's own series stay as `vllm serve` has them (all tenants together). A server without
API keys counts everything under tenant="none".
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

NO_TENANT = "none"
COUNTERS = {
    "prompt_tokens": "Prompt tokens of the tenant's requests that produced a first token.",
    "generation_tokens": "Tokens generated for the tenant.",
    "prefix_cache_queries": "Prompt tokens of the tenant looked up in the prefix cache.",
    "prefix_cache_hits": "Of those, tokens served from the prefix cache.",
}


class TenantMetrics:
    def __init__(self, registry: CollectorRegistry, labels: tuple[str, str]):
        self._labels = labels  # (model_name, engine)
        names = ("model_name", "engine", "tenant")
        self.requests = Counter(
            "kvlab:tenant_requests",
            "Requests of the tenant by outcome: finished (stop, length, abort, error) or "
            "refused (rejected: a 4xx; busy: a 429).",
            (*names, "outcome"),
            registry=registry,
        )
        self.counters = {
            key: Counter(f"kvlab:tenant_{key}", doc, names, registry=registry)
            for key, doc in COUNTERS.items()
        }
        self.running = Gauge(
            "kvlab:tenant_requests_running", "Requests in a place.", names, registry=registry
        )
        self.queued = Gauge(
            "kvlab:tenant_requests_queued", "Requests waiting.", names, registry=registry
        )

    def _label(self, tenant: str | None) -> tuple[str, str, str]:
        return (*self._labels, tenant or NO_TENANT)

    def outcome(self, tenant: str | None, outcome: str) -> None:
        self.requests.labels(*self._label(tenant), outcome).inc()

    def add(self, tenant: str | None, key: str, amount: float) -> None:
        self.counters[key].labels(*self._label(tenant)).inc(amount)

    def places(self, tenant: str | None, running: int, queued: int) -> None:
        self.running.labels(*self._label(tenant)).set(running)
        self.queued.labels(*self._label(tenant)).set(queued)
