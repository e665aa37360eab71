"""What the engine loop hands a request's handler, in order, through its `Channel`:
`Accepted` (or `Failed`), then `Delta`s, then `Done` (or `Failed`)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass


@dataclass(frozen=True)
class Accepted:
    request_id: int
    prompt_tokens: int


@dataclass(frozen=True)
class Delta:
    index: int  # the sample
    text: str  # its new text this step
    finish_reason: str | None  # "stop" | "length" once the sample is done


@dataclass(frozen=True)
class Done:
    usage: dict  # prompt_tokens, completion_tokens, total_tokens, prompt_tokens_details
    kvlab: dict  # kvlab's own fields: prefix hits, preemptions


@dataclass(frozen=True)
class Failed:
    message: str
    status: int = 400  # 400: the request; 500: it broke something; 503: the engine is down


class Channel:
    """The asyncio side of one request: the loop thread puts events, a handler awaits."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()

    def put(self, event) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody listens any more
            pass

    async def get(self):
        return await self._queue.get()
