"""`kvlab serve`: an OpenAI-compatible HTTP server over one engine, with vLLM's metrics.

    app.py          the routes: /v1/completions, /v1/chat/completions, /v1/models,
                    /health, /metrics; each request's checks, in order
    limits.py       the body before parsing: size (413), JSON, depth, lone surrogates
    protocol.py     the bodies as pydantic models (vLLM's ranges) -> a Job
    encoder.py      prompts -> token ids, in a thread of its own (never the engine's)
    tenants.py      API keys -> tenants; each tenant's (and cache_salt's) engine salt
    gate.py         per-tenant places in the engine and queues for them (429)
    loop.py         the engine loop thread: the only caller of the engine; continuous
                    batching, cancels, stop strings; one request's failure fails it alone
    events.py       what the loop hands a handler through a request's Channel
    detokenize.py   one sample's text as its tokens arrive (incremental, stop strings)
    streaming.py    the asyncio side: events -> server-sent events or one JSON body;
                    a disconnect -> a cancel
    responses.py    OpenAI's JSON shapes (responses, chunks, usage, errors, models)
    metrics.py      /metrics with vLLM's series names, labels and buckets
    tenant_metrics.py  per-tenant series under a `tenant` label
    server.py       Server (uvicorn), ServerThread (tests), engine_config (--config)
    soak.py         a bounded soak: concurrent streaming clients of several tenants,
                    disconnects, bad requests
    audit.py        the engine's block tables read for cross-tenant hits and shares
    probe.py        clients that time first tokens from outside, and a flooding tenant
    replay.py       a workload against any OpenAI-compatible server, with its /metrics

vLLM's own `vllm serve` and `vllm bench serve`, to compare with: kvlab.peers.vllm_serve.
Design of its isolation: docs/design/isolation.md.
Needs the `serve` extra: `pip install -e .[serve]` (fastapi, uvicorn, prometheus_client,
httpx).
"""

from __future__ import annotations

from kvlab.serve.server import Server, ServerThread, engine_config

__all__ = ["Server", "ServerThread", "engine_config"]
