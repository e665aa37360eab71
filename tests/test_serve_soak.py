"""A bounded soak of `kvlab serve` on loopback (issues 15 and 37): 64 concurrent streaming
clients of two tenants on the tiny model, random disconnects and bad requests mixed in
(malformed JSON, lone surrogates, deep nesting, out-of-range fields, a wrong API key).
Every good request must end with the text of a solo run, every bad one with its 4xx;
after it the server is up, the loop never died, no block is in use, and the audit of the
engine's block tables found hits within each tenant and none across them."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("fastapi")

import kvlab  # noqa: E402
from kvlab.serve import ServerThread, engine_config  # noqa: E402
from kvlab.serve.audit import TenantAudit  # noqa: E402
from kvlab.serve.soak import settle, soak  # noqa: E402
from kvlab.serve.tenants import Tenants  # noqa: E402

MAX_TOKENS = 12
TENANTS = Tenants((("sk-alice", "alice"), ("sk-bob", "bob")))


def soak_prompts() -> list[list[int]]:
    """12 prompts of 5-60 tokens; half of them share a 34-token prefix (prefix hits)."""
    shared = [300 + 11 * j for j in range(34)]
    own = [[1000 + 37 * i + 5 * j for j in range(5 + 5 * i)] for i in range(12)]
    return [shared + p[:8] if i % 2 else p for i, p in enumerate(own)]


def test_soak_64_streaming_clients_of_two_tenants_with_disconnects_and_bad_requests(tiny_model):
    prompts = soak_prompts()
    params = kvlab.SamplingParams(max_new_tokens=MAX_TOKENS, ignore_eos=True)
    solo = kvlab.Engine(tiny_model, engine_config("paged", max_model_len=256))
    expected = [solo.generate([p], params)[0].text for p in prompts]

    # 1,024 token slots, watermark admission: 64 clients do not fit, so requests preempt
    config = engine_config("paged+prefix+watermark", max_model_len=256, kv_budget_tokens=1024)
    engine = kvlab.Engine(tiny_model, config)
    audit = TenantAudit().install(engine)
    with ServerThread(engine, tenants=TENANTS) as server:
        report = asyncio.run(
            soak(server.url, tiny_model.name, prompts, expected, max_model_len=256,
                 max_tokens=MAX_TOKENS, clients=64, requests_per_client=2, seed=3,
                 keys=["sk-alice", "sk-bob"])
        )  # fmt: skip
        settle(server, report, audit)
        preemptions = server.loop.call(lambda e: e.scheduler.preemptions).result(10)
    assert report.unexpected == []
    assert report.requests == 128
    assert report.completed > 40 and report.disconnects > 10 and report.bad_requests > 10
    assert report.matched_solo == report.completed
    assert report.bad_answered_4xx == report.bad_requests
    assert report.server_up and report.leaked_blocks == 0 and report.crashes == 0
    assert report.audit["hit_admissions"] > 5 and report.audit["hit_blocks"] > 10
    assert report.audit["findings"] == []
    assert report.ok()
    assert preemptions > 0  # the budget was tight: preempted requests still match solo
