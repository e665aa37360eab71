"""The asyncio side of one request: its events from the engine loop, turned into
server-sent events (stream=true) or one JSON body, and a disconnect turned into a cancel.

Streaming: an `EventStream` response; however it ends (the answer is complete, the
client went away, writing failed), the request is cancelled in the engine unless it
completed (its blocks are freed before the next step) and `on_close` runs (the tenant's
place is handed on). A chunk that cannot be built ends that stream with an error event.
Not streaming: the handler awaits the next event and the disconnect message side by
side, whichever comes first.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import StreamingResponse

from kvlab.serve import responses
from kvlab.serve.events import Channel, Delta, Done, Failed
from kvlab.serve.loop import EngineLoop
from kvlab.serve.protocol import Job

log = logging.getLogger("kvlab.serve")
DONE = "data: [DONE]\n\n"


class ClientGone(Exception):
    """The client disconnected before its response was complete."""


async def wait_disconnect(request: Request) -> None:
    """Returns when the client disconnects (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def next_event(channel: Channel, disconnect: asyncio.Future):
    """The channel's next event, or ClientGone if the client leaves first."""
    get = asyncio.ensure_future(channel.get())
    done, _ = await asyncio.wait({get, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    if get in done:
        return get.result()
    get.cancel()
    raise ClientGone


class EventStream(StreamingResponse):
    """Server-sent events of one request: a chunk per sample per step, then (if asked)
    usage, then [DONE]."""

    def __init__(self, job: Job, channel: Channel, loop: EngineLoop, on_close: Callable):
        self.job, self.channel, self.loop, self.on_close = job, channel, loop, on_close
        self.complete = False
        super().__init__(self._events(), media_type="text/event-stream")

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.complete:  # the client went away, or writing failed
                self.loop.cancel(self.channel, "abort")
            self.on_close()

    async def _events(self) -> AsyncIterator[str]:
        ids = responses.ResponseIds(self.job)
        announced: set[int] = set()  # chat: samples whose role chunk went out
        while not self.complete:
            event = await self.channel.get()
            try:
                pieces = self._format(event, ids, announced)
            except Exception as error:  # noqa: BLE001 - it ends this stream only
                log.exception("a chunk of %s could not be built", ids.id)
                failed = Failed(f"streaming failed: {type(error).__name__}: {error}", 500)
                pieces = self._format(failed, ids, announced)
            for piece in pieces:
                yield piece

    def _format(self, event, ids: responses.ResponseIds, announced: set[int]) -> list[str]:
        """The server-sent events of one loop event (`complete` once it is the last)."""
        if isinstance(event, Delta):
            role = self.job.kind == "chat" and event.index not in announced
            announced.add(event.index)
            piece = responses.chunk(ids, event.index, event.text, event.finish_reason, role)
            return [responses.sse(piece)]
        if isinstance(event, Done):
            self.complete = True
            usage = responses.usage_chunk(ids, event.usage, event.kvlab)
            return [responses.sse(usage), DONE] if self.job.include_usage else [DONE]
        if isinstance(event, Failed):
            self.loop.cancel(self.channel, "error")  # a no-op once the loop has let it go
            self.complete = True
            return [responses.sse(responses.error(event.message, event.status)), DONE]
        return []


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
