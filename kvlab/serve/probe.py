"""Clients that measure a server from outside, over real HTTP: the time to a request's
first token, and a tenant that floods. benchmarks/tenant_flood.py and notebook 13's
timing attack are built from these.

    async with httpx.AsyncClient(headers=bearer("sk-bob")) as http:
        seconds = await first_token_s(http, url, {"prompt": ids, "max_tokens": 1})
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import httpx


def bearer(key: str | None) -> dict[str, str]:
    """The Authorization header of an API key (none for None)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


@dataclass(frozen=True)
class FirstToken:
    seconds: float  # from sending the request to its first chunk with text
    cached_tokens: int  # what the server's usage says hit its prefix cache


async def first_token(http: httpx.AsyncClient, url: str, body: dict) -> FirstToken:
    """Send `body` streamed (with usage) and time its first chunk with text; the stream is
    read to its end before returning. RuntimeError if the server refuses it."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    started, first, cached = time.perf_counter(), None, 0
    async with http.stream("POST", url, json=body) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"status {reply.status_code}: {(await reply.aread())[:200]!r}")
        async for line in reply.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[len("data: ") :])
            if first is None and event.get("choices"):
                first = time.perf_counter() - started
            if event.get("usage"):
                cached = event["usage"]["prompt_tokens_details"]["cached_tokens"]
    if first is None:
        raise RuntimeError("the stream ended without a chunk")
    return FirstToken(first, cached)


async def first_token_s(http: httpx.AsyncClient, url: str, body: dict) -> float:
    """Seconds to the first chunk with text of `body`, streamed (see `first_token`)."""
    return (await first_token(http, url, body)).seconds


@dataclass
class FloodCount:
    sent: int = 0
    completed: int = 0
    refused: int = 0  # 429s (each followed by a pause of `backoff_s`)


async def flood(
    url: str, body: dict, key: str | None, clients: int, until: asyncio.Event, backoff_s=0.1
) -> FloodCount:
    """`clients` connections of one tenant, each sending `body` again as soon as its last
    answer came, until `until` is set."""
    count = FloodCount()

    async def client(http: httpx.AsyncClient) -> None:
        while not until.is_set():
            count.sent += 1
            reply = await http.post(url, json=body)
            if reply.status_code == 429:
                count.refused += 1
                await asyncio.sleep(backoff_s)
            else:
                reply.raise_for_status()
                count.completed += 1

    async with httpx.AsyncClient(timeout=600, headers=bearer(key)) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    return count
