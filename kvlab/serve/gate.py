"""Per-tenant limits: how many of a tenant's requests the engine holds, and how many wait.

A tenant may have `tenant_max_running` requests in the engine at once (queued or running
there); its next ones wait here, in arrival order, up to `tenant_max_queued` of them, and
past that get a 429 with `Retry-After` before anything is queued. Since no tenant holds
more than its share of the engine's queue, a tenant that floods the server delays only
itself: another tenant's request waits behind at most `tenant_max_running` requests of
each tenant, not behind the whole flood (benchmarks/tenant_flood.py measures it).

Everything here runs on the asyncio event loop (no locks); a request holds its `Slot`
until its response ends, however it ends.
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from collections.abc import Callable

from kvlab.serve.limits import ServeLimits
from kvlab.serve.protocol import BadRequest


class TooBusy(BadRequest):
    """A 429: the tenant already has as many requests running and queued as it may."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message, status=429)
        self.retry_after_s = retry_after_s


class Slot:
    """One request's place in the engine; `release` (idempotent) hands it on."""

    def __init__(self, gate: TenantGate, tenant: str | None):
        self.gate, self.tenant, self._held = gate, tenant, True

    def release(self) -> None:
        if self._held:
            self._held = False
            self.gate._leave(self.tenant)


class TenantGate:
    """`on_change(tenant)` runs whenever that tenant's running or queued count changes
    (the server's gauges follow it, a waiting request included).

    The counts change only in plain (never awaiting) code: a leaving request hands its
    place to the first waiter there and then, so `running` and `queued` are exact at
    every await; nothing counts as waiting once it holds a place."""

    def __init__(
        self, limits: ServeLimits, on_change: Callable[[str | None], None] = lambda _t: None
    ):
        self.limits, self.on_change = limits, on_change
        self.running: Counter = Counter()  # tenant -> requests holding a place
        self.queued: Counter = Counter()  # tenant -> requests waiting for one
        self._waiting: dict[str | None, deque[asyncio.Future]] = {}  # tenant -> in order

    async def enter(self, tenant: str | None, gone: asyncio.Future) -> Slot | None:
        """A slot for one of `tenant`'s requests, once one is free; TooBusy (429) if its
        queue is full; None if the client left (`gone` finished) while it waited."""
        limit = self.limits.tenant_max_running
        if limit is None or self.running[tenant] < limit:  # a free place: no one waits
            self.running[tenant] += 1
            self.on_change(tenant)
            return Slot(self, tenant)
        most = self.limits.tenant_max_queued
        if most is not None and self.queued[tenant] >= most:
            raise TooBusy(
                f"tenant {tenant!r} has {self.running[tenant]} requests running and "
                f"{self.queued[tenant]} queued, the most it may (--tenant-max-running="
                f"{limit}, --tenant-max-queued={most}): retry later",
                self.limits.retry_after_s,
            )
        place = asyncio.get_running_loop().create_future()  # done: `_leave` handed one on
        self._waiting.setdefault(tenant, deque()).append(place)
        self.queued[tenant] += 1
        self.on_change(tenant)
        try:
            await asyncio.wait({place, gone}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # the handler itself is cancelled (the server stops)
            self._give_up(tenant, place)
            raise
        if gone.done():  # the client left, maybe just as a place came: hand it on
            self._give_up(tenant, place)
            return None
        return Slot(self, tenant)

    def _give_up(self, tenant: str | None, place: asyncio.Future) -> None:
        """A waiter leaves: out of the queue, or, if it was just handed a place, on with it."""
        if place.done():
            self._leave(tenant)
            return
        place.cancel()
        self._waiting[tenant].remove(place)
        self.queued[tenant] -= 1
        self.on_change(tenant)

    def _leave(self, tenant: str | None) -> None:
        waiting = self._waiting.get(tenant)
        if waiting:  # the place passes to the first waiter: `running` stays as it is
            waiting.popleft().set_result(None)
            self.queued[tenant] -= 1
        else:
            self.running[tenant] -= 1
        self.on_change(tenant)
