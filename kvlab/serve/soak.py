"""A bounded soak on loopback: many concurrent streaming clients against one server, with
random disconnects and bad requests mixed in, across tenants.

Each client sends `requests_per_client` requests one after another; each is, at random,
a good one (streamed, or now and then not; now and then with a cache_salt), a disconnect
(streamed, the connection closed after a few chunks) or a bad one (malformed JSON, an
unknown model, a prompt past max_model_len, max_tokens <= 0, a bad temperature or top_k,
a lone surrogate, nesting past the JSON depth, a wrong API key). With `keys`, client i
is the tenant of keys[i % len(keys)]. A good request must end with the text a solo run
gives (`expected`, greedy, ignore_eos); a bad one must get its 4xx. `settle` then waits
for the server to go idle and fills in what the engine says: blocks still in use, the
loop's life, and the tenant audit of its block tables (kvlab.serve.audit).

    audit = TenantAudit().install(engine)           # before the server starts
    report = asyncio.run(soak(url, model_name, prompts, expected, max_model_len=512))
    settle(server, report, audit)
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field

import httpx

from kvlab.serve.audit import TenantAudit


@dataclass
class SoakReport:
    clients: int
    requests: int = 0
    completed: int = 0  # good requests answered in full
    matched_solo: int = 0  # of those, text identical to the solo run
    disconnects: int = 0  # streams the client closed mid-answer
    bad_requests: int = 0
    bad_answered_4xx: int = 0  # of those, answered with the expected 4xx
    unexpected: list[str] = field(default_factory=list)  # anything else, described
    server_up: bool | None = None  # /health answered 200 after the soak
    leaked_blocks: int | None = None  # blocks still referenced once idle (`settle`)
    crashes: int | None = None  # 1 if the engine loop died (`settle`)
    audit: dict | None = None  # the tenant audit of the block tables (`settle`)

    def ok(self) -> bool:
        audit = self.audit or {}
        return (
            not self.unexpected
            and self.matched_solo == self.completed
            and self.bad_answered_4xx == self.bad_requests
            and self.server_up is True
            and self.leaked_blocks == 0
            and self.crashes == 0
            and audit.get("cross_tenant_hits", 0) == 0
            and audit.get("cross_tenant_shares", 0) == 0
        )

    def as_dict(self) -> dict:
        return asdict(self)


def bad_bodies(model: str, max_model_len: int) -> list[tuple[bytes | dict, int, str]]:
    """(body, expected status, text the error message must contain); None: a wrong key."""
    return [
        (b"{not json", 400, "malformed JSON"),
        (b'{"prompt": "\\ud800 hi"}', 400, "lone UTF-16 surrogate"),
        (b'{"prompt": "hi", "x": ' + b"[" * 200 + b"]" * 200 + b"}", 400, "max_json_depth"),
        ({"model": model, "prompt": "hi", "top_k": -7}, 400, "top_k=-7"),
        (None, 401, "API key"),
        ({"model": "no-such-model", "prompt": "hi"}, 404, "does not exist"),
        ({"model": model, "prompt": [1] * (max_model_len + 1)}, 400, "max_model_len"),
        ({"model": model, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens=0"),
        ({"model": model, "prompt": "hi", "max_tokens": -3}, 400, "max_tokens=-3"),
        ({"model": model, "prompt": "hi", "temperature": -1}, 400, "temperature"),
    ]


async def _stream(http, url, body, stop_after: int | None) -> tuple[str, int]:
    """The streamed text and chunk count; stop_after: close after that many chunks."""
    text, chunks = "", 0
    async with http.stream("POST", url, json={**body, "stream": True}) as response:
        if response.status_code != 200:
            raise RuntimeError(f"status {response.status_code}: {await response.aread()!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                raise RuntimeError(f"error event: {event['error']}")
            text += "".join(c.get("text", "") for c in event["choices"])
            chunks += 1
            if stop_after is not None and chunks >= stop_after:
                return text, chunks  # leaving the block closes the connection
    return text, chunks


async def soak(
    base_url: str,
    model: str,
    prompts: list[list[int]],
    expected: list[str],
    max_model_len: int,
    max_tokens: int = 16,
    clients: int = 64,
    requests_per_client: int = 2,
    disconnect_rate: float = 0.2,
    bad_rate: float = 0.15,
    seed: int = 0,
    timeout_s: float = 600.0,
    keys: list[str] | None = None,
) -> SoakReport:
    """Run the soak against `base_url` (a server serving `model`); `expected[i]` is the
    greedy, ignore_eos text of `prompts[i]` with `max_tokens` tokens, from a solo run;
    `keys`: the tenants' API keys (None: an open server)."""
    rng = random.Random(seed)
    report = SoakReport(clients=clients)
    url = f"{base_url}/v1/completions"
    bad = bad_bodies(model, max_model_len)

    async def client(number: int, plan: list[tuple]) -> None:
        key = keys[number % len(keys)] if keys else "none"
        headers = {"Authorization": f"Bearer {key}"}
        async with httpx.AsyncClient(timeout=timeout_s, headers=headers) as http:
            for kind, index in plan:
                report.requests += 1
                try:
                    await one(http, kind, index)
                except Exception as error:  # noqa: BLE001 - every failure is reported
                    report.unexpected.append(f"{kind} #{index}: {type(error).__name__}: {error}")

    async def one(http: httpx.AsyncClient, kind: str, index: int) -> None:
        if kind == "bad":
            body, status, words = bad[index]
            if body is None and not keys:  # an open server has no wrong key
                body, status, words = bad[0]
            report.bad_requests += 1
            if body is None:
                wrong = {"Authorization": "Bearer not-a-key"}
                response = await http.post(url, json={"prompt": "hi"}, headers=wrong)
            elif isinstance(body, bytes):
                headers = {"content-type": "application/json"}
                response = await http.post(url, content=body, headers=headers)
            else:
                response = await http.post(url, json=body)
            message = response.json().get("error", {}).get("message", "")
            if response.status_code == status and words in message:
                report.bad_answered_4xx += 1
            else:
                report.unexpected.append(f"bad #{index}: {response.status_code} {message!r}")
            return
        body = {"model": model, "prompt": prompts[index], "max_tokens": max_tokens}
        body.update(temperature=0, ignore_eos=True)
        if rng.random() < 0.2:  # a user of its own within the tenant
            body["cache_salt"] = f"user-{rng.randrange(3)}"
        if kind == "disconnect":
            await _stream(http, url, body, stop_after=rng.randint(1, 3))
            report.disconnects += 1
            return
        if kind == "whole":
            response = await http.post(url, json=body)
            response.raise_for_status()
            text = response.json()["choices"][0]["text"]
        else:
            text, _ = await _stream(http, url, body, stop_after=None)
        report.completed += 1
        report.matched_solo += text == expected[index]

    def draw() -> tuple[str, int]:
        roll = rng.random()
        if roll < bad_rate:
            return "bad", rng.randrange(len(bad))
        kind = "disconnect" if roll < bad_rate + disconnect_rate else "stream"
        if kind == "stream" and rng.random() < 0.2:
            kind = "whole"
        return kind, rng.randrange(len(prompts))

    plans = [[draw() for _ in range(requests_per_client)] for _ in range(clients)]
    await asyncio.gather(*(client(number, plan) for number, plan in enumerate(plans)))
    try:
        report.server_up = httpx.get(f"{base_url}/health", timeout=30).status_code == 200
    except httpx.HTTPError:
        report.server_up = False
    return report


def settle(server, report: SoakReport, audit: TenantAudit | None, timeout_s=60.0) -> None:
    """Wait for the server's engine to go idle; check its integrity; fill in the report's
    leaked blocks, crashes and tenant audit."""
    loop, deadline = server.loop, time.monotonic() + timeout_s
    while loop.alive and loop.call(lambda e: e.has_unfinished()).result(timeout_s):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the engine did not go idle in {timeout_s:.0f} s")
        time.sleep(0.05)
    loop.call(lambda e: e.cache.check_integrity()).result(timeout_s)
    report.leaked_blocks = loop.call(lambda e: e.cache.allocator.num_used).result(timeout_s)
    report.crashes = int(loop.dead is not None)
    report.audit = audit.summary() if audit else None
