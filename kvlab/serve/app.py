"""The HTTP routes (FastAPI): OpenAI's /v1/completions, /v1/chat/completions and
/v1/models, vLLM's /health and /metrics, over one EngineLoop.

A handler parses the body (400 for malformed JSON or a bad field, 404 for an unknown
model), hands the Job to the engine loop and waits for its verdict (the engine's own
ValueErrors, e.g. a prompt past max_model_len or a request the KV budget can never hold,
come back as 400s naming the limit), then streams or collects the answer. Nothing a
request does stops the server serving the others.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvlab.serve import responses
from kvlab.serve.loop import Channel, EngineLoop, Failed
from kvlab.serve.metrics import ServeMetrics
from kvlab.serve.protocol import BadRequest, parse_body, parse_chat, parse_completion
from kvlab.serve.streaming import ClientGone, collect, next_event, stream_events, wait_disconnect

CLIENT_CLOSED = 499  # nginx's status for "the client closed the connection"


def error_response(message: str, status: int, param: str | None = None) -> JSONResponse:
    return JSONResponse(responses.error(message, status, param), status_code=status)


def build_app(loop: EngineLoop, metrics: ServeMetrics, model_name: str) -> FastAPI:
    """The app serving `loop`'s engine under the name `model_name`."""
    app = FastAPI(title="kvlab serve", docs_url=None, redoc_url=None)
    created = int(time.time())
    max_model_len = loop.engine.max_model_len

    async def handle(request: Request, parse) -> Response:
        try:
            job = parse(parse_body(await request.body()), model_name)
        except BadRequest as bad:
            return error_response(str(bad), bad.status, bad.param)
        channel = Channel()
        loop.submit(job, channel)
        disconnect = asyncio.ensure_future(wait_disconnect(request))
        try:
            verdict = await next_event(channel, disconnect)  # Accepted or Failed
        except ClientGone:
            loop.cancel(channel, "abort")
            return Response(status_code=CLIENT_CLOSED)
        finally:
            disconnect.cancel()
        if isinstance(verdict, Failed):
            return error_response(verdict.message, verdict.status)
        if job.stream:
            events = stream_events(job, channel, loop)
            return StreamingResponse(events, media_type="text/event-stream")
        try:
            body = await collect(job, channel, loop, request)
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        if isinstance(body, Failed):
            return error_response(body.message, body.status)
        return JSONResponse(body)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, parse_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle(request, parse_chat)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(responses.model_list(model_name, max_model_len, created))

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if loop.alive else 503)

    @app.get("/metrics")
    async def metrics_page() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    return app
