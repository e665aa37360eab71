"""The asyncio side of one request: its events from the engine loop, turned into
server-sent events (stream=true) or one JSON body, and a disconnect turned into a cancel.

Streaming: Starlette watches the connection while it streams and, when the client goes
away, cancels the generator at its `await`; the `finally` then cancels the request in
the engine, which frees its blocks before the next step. Not streaming: the handler
awaits the next event and the disconnect message side by side, whichever comes first.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from starlette.requests import Request

from kvlab.serve import responses
from kvlab.serve.loop import Channel, Delta, Done, EngineLoop, Failed
from kvlab.serve.protocol import Job


class ClientGone(Exception):
    """The client disconnected before its response was complete."""


async def wait_disconnect(request: Request) -> None:
    """Returns when the client disconnects (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def next_event(channel: Channel, disconnect: asyncio.Task):
    """The channel's next event, or ClientGone if the client leaves first."""
    get = asyncio.ensure_future(channel.get())
    done, _ = await asyncio.wait({get, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    if get in done:
        return get.result()
    get.cancel()
    raise ClientGone


async def stream_events(job: Job, channel: Channel, loop: EngineLoop) -> AsyncIterator[str]:
    """Server-sent events of one request: a chunk per sample per step, then (if asked)
    usage, then [DONE]."""
    ids, complete = responses.ResponseIds(job), False
    announced: set[int] = set()  # chat: samples whose role chunk went out
    try:
        while True:
            event = await channel.get()
            if isinstance(event, Delta):
                role = job.kind == "chat" and event.index not in announced
                announced.add(event.index)
                piece = responses.chunk(ids, event.index, event.text, event.finish_reason, role)
                yield responses.sse(piece)
            elif isinstance(event, Done):
                complete = True
                if job.include_usage:
                    yield responses.sse(responses.usage_chunk(ids, event.usage, event.kvlab))
                yield responses.sse("[DONE]")
                return
            elif isinstance(event, Failed):
                complete = True
                yield responses.sse(responses.error(event.message, event.status))
                yield responses.sse("[DONE]")
                return
    finally:
        if not complete:  # the client went away (or the server is stopping)
            loop.cancel(channel, "abort")


async def collect(job: Job, channel: Channel, loop: EngineLoop, request: Request):
    """The whole response of a non-streamed request (a dict), or a Failed event."""
    ids = responses.ResponseIds(job)
    texts, finishes = [""] * job.params.n, [None] * job.params.n
    disconnect = asyncio.ensure_future(wait_disconnect(request))
    complete = False
    try:
        while True:
            event = await next_event(channel, disconnect)
            if isinstance(event, Delta):
                texts[event.index] += event.text
                finishes[event.index] = event.finish_reason or finishes[event.index]
            elif isinstance(event, Done):
                complete = True
                return responses.whole(ids, texts, finishes, event.usage, event.kvlab)
            elif isinstance(event, Failed):
                complete = True
                return event
    finally:
        disconnect.cancel()
        if not complete:
            loop.cancel(channel, "abort")
