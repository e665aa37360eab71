"""The router over HTTP: OpenAI's routes in front of N backends (FastAPI, httpx).

    POST /v1/completions, /v1/chat/completions   routed by the policy, streamed through
    GET  /v1/models                              the first backend's answer
    GET  /health                                 200 while the router runs
    GET  /metrics                                requests per replica, in flight, index size
    GET  /router/state                           policy, replicas, event feeds (JSON)
    GET  /router/decisions?since=N               every decision: replica, reason, scores
    POST /router/policy {"policy": "precise"}    switch policy (benchmarks, notebooks)

A request's body goes to the chosen backend unchanged; the answer comes back byte for
byte (server-sent events included), with an `x-kvlab-replica` header naming the replica.
To hash a chat or a text prompt the router needs the backends' tokenizer (and chat
template): with one (`--tokenizer`) it encodes the prompt as the backends will, in a
worker thread; without one only token-id prompts get token hashes.
"""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from kvlab.route.policies import RoutedRequest
from kvlab.route.router import Router

PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
FORWARDED = ("authorization", "content-type", "accept")


def routed_request(body: dict, kind: str, tokenizer) -> RoutedRequest:
    """What the policies look at: the prompt as text, its token ids where the router can
    know them (as the backend will: chat template included), the cache salt."""
    from kvlab.model.prompts import encode_messages, encode_prompt

    salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
    user = body.get("user") if isinstance(body.get("user"), str) else None
    ids = None
    if kind == "chat":
        messages = body.get("messages") or []
        text = "".join(f"{m.get('role')}: {_content(m.get('content'))}\n" for m in messages)
        if tokenizer is not None:
            plain = [{**m, "content": _content(m.get("content"))} for m in messages]
            ids = encode_messages(tokenizer, plain)
        return RoutedRequest(text, ids, salt, user)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return RoutedRequest(" ".join(map(str, prompt)), list(prompt), salt, user)
    text = prompt if isinstance(prompt, str) else json.dumps(prompt)
    if tokenizer is not None and isinstance(prompt, str):
        ids = encode_prompt(tokenizer, prompt, chat=False)
    return RoutedRequest(text, ids, salt, user)


def _content(content) -> str:
    if isinstance(content, list):  # OpenAI's content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def build_app(router: Router, timeout_s: float = 3600.0) -> FastAPI:
    encode_pool = ThreadPoolExecutor(1, thread_name_prefix="kvlab-route-encode")
    clients: dict[str, httpx.AsyncClient] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
        clients["http"] = httpx.AsyncClient(timeout=timeout_s, limits=limits)
        router.start()
        try:
            yield
        finally:
            await clients["http"].aclose()
            router.stop()
            encode_pool.shutdown(wait=False)

    app = FastAPI(title="kvlab route", docs_url=None, redoc_url=None, lifespan=lifespan)

    async def forward(request: Request, kind: str) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
            loop = asyncio.get_running_loop()
            routed = await loop.run_in_executor(
                encode_pool, routed_request, body, kind, router.tokenizer
            )
        except Exception as error:  # noqa: BLE001 - the backend would refuse it too
            message = f"the router cannot read this request: {type(error).__name__}: {error}"
            return JSONResponse({"error": {"message": message, "code": 400}}, status_code=400)
        replica, entry = router.choose(routed)
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED}
        http = clients["http"]
        start = time.perf_counter()
        try:
            upstream = await http.send(
                http.build_request("POST", replica.url + PATHS[kind], content=raw, headers=headers),
                stream=True,
            )
        except httpx.HTTPError as error:
            router.finished(replica, entry, None, 502)
            message = f"backend {replica.name} ({replica.url}) failed: {error}"
            return JSONResponse({"error": {"message": message, "code": 502}}, status_code=502)

        async def relay():
            first = None
            try:
                async for chunk in upstream.aiter_raw():
                    if first is None:
                        first = time.perf_counter() - start
                    yield chunk
            finally:
                await upstream.aclose()
                router.finished(replica, entry, first, upstream.status_code)

        media = upstream.headers.get("content-type")
        return StreamingResponse(
            relay(),
            status_code=upstream.status_code,
            media_type=media,
            headers={"x-kvlab-replica": replica.name},
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await forward(request, "completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await forward(request, "chat")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        answer = await clients["http"].get(router.replicas[0].url + "/v1/models", headers=headers)
        return Response(answer.content, answer.status_code, media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/router/state")
    async def state() -> Response:
        return JSONResponse(router.state())

    @app.get("/router/decisions")
    async def decisions(since: int = 0) -> Response:
        return JSONResponse([d for d in list(router.decisions) if d["i"] >= since])

    @app.post("/router/policy")
    async def policy(request: Request) -> Response:
        try:
            body = await request.json()
            router.set_policy(body["policy"])
        except (ValueError, KeyError, TypeError) as error:
            return JSONResponse({"error": {"message": str(error), "code": 400}}, status_code=400)
        return JSONResponse(router.state())

    @app.post("/router/reset")
    async def reset() -> Response:
        router.reset_counts()
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(render_metrics(router), media_type="text/plain; version=0.0.4")

    return app


def render_metrics(router: Router) -> str:
    """The router's series in Prometheus' text format."""
    state = router.state()
    lines = [
        "# HELP kvlab_route_requests_total Requests routed to each replica.",
        "# TYPE kvlab_route_requests_total counter",
    ]
    rows = state["replicas"]
    lines += [f'kvlab_route_requests_total{{replica="{r["name"]}"}} {r["routed"]}' for r in rows]
    lines += ["# HELP kvlab_route_in_flight Requests in flight per replica.",
              "# TYPE kvlab_route_in_flight gauge"]  # fmt: skip
    lines += [f'kvlab_route_in_flight{{replica="{r["name"]}"}} {r["in_flight"]}' for r in rows]
    lines += ["# HELP kvlab_route_index_blocks Blocks each replica holds, from its KV events.",
              "# TYPE kvlab_route_index_blocks gauge"]  # fmt: skip
    lines += [
        f'kvlab_route_index_blocks{{replica="{r["name"]}"}} {r["index_blocks"]}' for r in rows
    ]
    return "\n".join(lines) + "\n"
