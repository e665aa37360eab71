"""The HTTP routes (FastAPI): OpenAI's /v1/completions, /v1/chat/completions and
/v1/models, vLLM's /health and /metrics, over one EngineLoop.

A completion request passes, in order: the API key (401), the body's size (413), its
JSON, nesting and strings (400), the fields (400 naming the field and the limit; 404
for an unknown model), the tokenizer (400) and the tenant's places (429 with
Retry-After). Only then does the engine loop see it; its verdict (the engine's own
ValueErrors, e.g. a prompt past max_model_len, come back as 400s) decides whether the
answer streams or is collected. Whatever one request raises on the way fails it alone
(500); the bodies are described in the OpenAPI schema (/openapi.json).

Admin routes (/reset_prefix_cache, whose effect reaches every tenant) take only the admin
key on a server with keys (kvlab.serve.tenants).
"""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from pydantic.json_schema import models_json_schema

from kvlab.serve import responses
from kvlab.serve.encoder import Encoder
from kvlab.serve.events import Channel, Failed
from kvlab.serve.gate import Slot, TenantGate, TooBusy
from kvlab.serve.limits import ServeLimits, load_json, read_body
from kvlab.serve.loop import EngineLoop
from kvlab.serve.metrics import ServeMetrics
from kvlab.serve.protocol import BODIES, BadRequest, Job, parse
from kvlab.serve.streaming import ClientGone, EventStream, collect, next_event, wait_disconnect
from kvlab.serve.tenants import Tenants

log = logging.getLogger("kvlab.serve")
CLIENT_CLOSED = 499  # nginx's status for "the client closed the connection"
PATHS = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}


def error_response(message: str, status: int, param: str | None = None, headers=None):
    body = responses.error(message, status, param)
    return JSONResponse(body, status_code=status, headers=headers)


def build_app(
    loop: EngineLoop,
    metrics: ServeMetrics,
    model_name: str,
    encoder: Encoder,
    tenants: Tenants | None = None,
    limits: ServeLimits | None = None,
) -> FastAPI:
    """The app serving `loop`'s engine under the name `model_name`."""
    tenants, limits = tenants or Tenants(), limits or ServeLimits()
    app = FastAPI(title="kvlab serve", docs_url=None, redoc_url=None)
    created = int(time.time())
    max_model_len = loop.engine.max_model_len

    async def handle(request: Request, kind: str) -> Response:
        tenant = tenants.authenticate(request.headers.get("authorization"))
        if tenants.required and tenant is None:
            return error_response("a valid API key is required (Authorization: Bearer)", 401)
        if loop.dead:
            return error_response(f"the engine cannot go on: {loop.dead}", 503)
        try:
            body = load_json(await read_body(request, limits), limits)
            job = parse(body, kind, model_name, tenant)
            job.prompt_ids = await encoder(job)
        except BadRequest as bad:
            metrics.tenants.outcome(tenant, "rejected")
            return error_response(str(bad), bad.status, bad.param)
        except Exception as error:  # noqa: BLE001 - one request's failure, never the server
            log.exception("a request could not be read or tokenized")
            return error_response(f"encoding failed: {type(error).__name__}: {error}", 500)
        disconnect = asyncio.ensure_future(wait_disconnect(request))
        try:
            slot = await gate.enter(tenant, disconnect)
        except TooBusy as busy:
            disconnect.cancel()
            metrics.tenants.outcome(tenant, "busy")
            headers = {"Retry-After": str(busy.retry_after_s)}
            return error_response(str(busy), 429, headers=headers)
        if slot is None:
            return Response(status_code=CLIENT_CLOSED)
        return await serve(request, job, slot, disconnect)

    async def serve(request: Request, job: Job, slot: Slot, disconnect) -> Response:
        """Hand the job to the engine loop; its answer, streamed or whole."""
        channel, streaming = Channel(), False
        try:
            loop.submit(job, channel)
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
                streaming = True
                return EventStream(job, channel, loop, on_close=slot.release)
            try:
                body = await collect(job, channel, loop, request)
            except ClientGone:
                return Response(status_code=CLIENT_CLOSED)
            if isinstance(body, Failed):
                return error_response(body.message, body.status)
            return JSONResponse(body)
        except Exception as error:  # noqa: BLE001 - one request's failure, never the server
            log.exception("request failed in the HTTP layer")
            loop.cancel(channel, "error")
            return error_response(f"serving failed: {type(error).__name__}: {error}", 500)
        finally:
            if not streaming:
                slot.release()

    def places(tenant: str | None) -> None:
        metrics.tenants.places(tenant, gate.running[tenant], gate.queued[tenant])

    gate = TenantGate(limits, on_change=places)  # the gauges follow every change

    for kind, path in PATHS.items():
        app.add_api_route(
            path,
            _endpoint(handle, kind),
            methods=["POST"],
            openapi_extra=_request_body(BODIES[kind].__name__),
            summary=f"OpenAI's {path}",
        )

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        if tenants.required and tenants.authenticate(request.headers.get("authorization")) is None:
            return error_response("a valid API key is required (Authorization: Bearer)", 401)
        return JSONResponse(responses.model_list(model_name, max_model_len, created))

    @app.get("/health")
    async def health() -> Response:
        if loop.alive:
            return Response(status_code=200)
        reason = loop.dead or "the engine loop is not running"
        return error_response(f"the engine cannot go on: {reason}", 503)

    def admin_only(request: Request) -> Response | None:
        """None if the caller may use an admin route: anyone on an open server, else the
        admin key alone (401 without a known key, 403 with a tenant's)."""
        authorization = request.headers.get("authorization")
        if not tenants.guards_admin or tenants.is_admin(authorization):
            return None
        if tenants.authenticate(authorization) is None:
            return error_response("this route needs the admin API key (--admin-api-key)", 401)
        return error_response(
            f"{request.url.path} is an admin route: it takes the admin API key "
            "(--admin-api-key), not a tenant's; a fresh cache_salt gives a tenant a cold cache",
            403,
        )

    @app.post("/reset_prefix_cache", include_in_schema=False)
    async def reset_prefix_cache(request: Request) -> Response:
        """vLLM's route (its dev mode): forget every cached block, every tenant's, when no
        request holds one; KV events report AllBlocksCleared. 409 while requests hold
        blocks. An admin route: see `admin_only`."""
        denied = admin_only(request)
        if denied is not None:
            return denied
        reset = getattr(loop.engine.cache, "reset_prefix_cache", None)
        if reset is None:
            return error_response("this engine's cache keeps no prefix cache", 400)
        if not await asyncio.wrap_future(loop.call(lambda engine: reset())):
            return error_response("requests hold blocks: the prefix cache was not reset", 409)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics_page() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    app.openapi = lambda: _openapi(app, tenants.required)
    return app


def _endpoint(handle, kind: str):
    async def endpoint(request: Request) -> Response:
        return await handle(request, kind)

    return endpoint


def _request_body(name: str) -> dict:
    schema = {"$ref": f"#/components/schemas/{name}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _openapi(app: FastAPI, keys: bool) -> dict:
    """The app's OpenAPI schema, with the request bodies' pydantic schemas."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version="1", routes=app.routes)
        models = [(body, "validation") for body in BODIES.values()]
        _, definitions = models_json_schema(models, ref_template="#/components/schemas/{model}")
        schema.setdefault("components", {})["schemas"] = definitions["$defs"]
        if keys:
            bearer = {"bearer": {"type": "http", "scheme": "bearer"}}
            schema["components"]["securitySchemes"] = bearer
            schema["security"] = [{"bearer": []}]
        app.openapi_schema = schema
    return app.openapi_schema
