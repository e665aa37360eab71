"""Tenants of `kvlab serve`: API keys (401), a salted prefix cache per tenant (and per
cache_salt within one), per-tenant places and queues (429 with Retry-After), per-tenant
series on /metrics, the audit that reads the block tables for cross-tenant hits, and the
admin key that alone may flush the prefix cache every tenant shares (403 for a tenant).
The tiny model serves; clients are the openai SDK and httpx.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

import kvlab  # noqa: E402
from kvlab.cache.prefix.hash import HashPrefixIndex  # noqa: E402
from kvlab.serve import ServerThread, engine_config  # noqa: E402
from kvlab.serve.audit import TenantAudit  # noqa: E402
from kvlab.serve.limits import ServeLimits  # noqa: E402
from kvlab.serve.tenants import Tenants, engine_salt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ADMIN = "sk-admin"
KEYS = Tenants((("sk-alice", "alice"), ("sk-bob", "bob")), admin_key=ADMIN)
PROMPT = list(range(300, 348))  # 3 full blocks of 16


def sdk(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)


def on_engine(server, fn):
    return server.loop.call(fn).result(timeout=30)


def scrape(server, prefix: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    values = {}
    for family in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text):
        for s in family.samples:
            if s.name.startswith(prefix):
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k == "tenant")
                values[f"{s.name}{{{labels},{s.labels.get('outcome', '')}}}"] = s.value
    return values


@pytest.fixture(scope="module")
def keyed(tiny_model):
    engine = kvlab.Engine(tiny_model, engine_config("paged+prefix", max_model_len=256))
    audit = TenantAudit().install(engine)
    with ServerThread(engine, tenants=KEYS) as server:
        server.audit = audit
        yield server


def test_api_keys_are_required_on_v1_only(keyed, tiny_model):
    with pytest.raises(openai.AuthenticationError, match="API key"):
        sdk(keyed, "sk-mallory").completions.create(model=tiny_model.name, prompt="hi")
    reply = httpx.post(f"{keyed.url}/v1/completions", json={"prompt": "hi"})
    assert reply.status_code == 401 and reply.json()["error"]["type"] == "AuthenticationError"
    assert httpx.get(f"{keyed.url}/v1/models").status_code == 401
    assert [m.id for m in sdk(keyed, "sk-bob").models.list()] == [tiny_model.name]
    assert httpx.get(f"{keyed.url}/health").status_code == 200  # as vLLM: open
    assert httpx.get(f"{keyed.url}/metrics").status_code == 200
    schema = httpx.get(f"{keyed.url}/openapi.json").json()
    assert schema["security"] == [{"bearer": []}]


def test_tenants_never_share_blocks_and_cache_salt_splits_a_tenant(keyed, tiny_model):
    def cached(key: str, **extra) -> int:
        reply = sdk(keyed, key).completions.create(
            model=tiny_model.name, prompt=PROMPT, max_tokens=2, extra_body=extra
        )
        return reply.usage.prompt_tokens_details.cached_tokens

    before = scrape(keyed, "kvlab:tenant_prefix_cache_hits")
    assert [cached("sk-alice"), cached("sk-alice")] == [0, 32]  # the last block is partial
    assert [cached("sk-bob"), cached("sk-bob")] == [0, 32]  # bob never reads alice's
    assert [cached("sk-alice", cache_salt="u1"), cached("sk-alice", cache_salt="u1")] == [0, 32]
    assert cached("sk-alice", cache_salt="u2") == 0
    after = scrape(keyed, "kvlab:tenant_prefix_cache_hits")
    for tenant, hits in (("alice", 64), ("bob", 32)):
        key = f"kvlab:tenant_prefix_cache_hits_total{{tenant={tenant},}}"
        assert after[key] - before.get(key, 0) == hits
    audit = keyed.audit.summary()
    assert audit["hit_blocks"] >= 6 and audit["cross_tenant_hits"] == 0
    assert audit["cross_tenant_shares"] == 0
    assert engine_salt("a", None) != engine_salt(None, "a")  # no cache_salt spells a tenant


def test_only_the_admin_key_resets_the_prefix_cache(keyed, tiny_model):
    """/reset_prefix_cache forgets every tenant's blocks, so a tenant's key gets 403 (in
    OpenAI's error shape) and changes nobody's hits; the admin key's reset forgets them all."""
    prompt = list(range(500, 548))  # 3 full blocks no other test here sends
    url = f"{keyed.url}/reset_prefix_cache"

    def cached(key: str) -> int:
        reply = sdk(keyed, key).completions.create(
            model=tiny_model.name, prompt=prompt, max_tokens=2
        )
        return reply.usage.prompt_tokens_details.cached_tokens

    def reset(key: str | None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.post(url, headers=headers, timeout=30)

    def cached_blocks() -> int:
        return on_engine(keyed, lambda engine: len(engine.cache.allocator.cached))

    assert [cached("sk-alice"), cached("sk-alice")] == [0, 32]
    held = cached_blocks()
    denied = reset("sk-bob")
    assert denied.status_code == 403
    assert set(denied.json()) == {"error"}
    error = denied.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "PermissionDeniedError" and error["code"] == 403
    assert "--admin-api-key" in error["message"] and "cache_salt" in error["message"]
    assert [reset(None).status_code, reset("sk-mallory").status_code] == [401, 401]
    assert cached_blocks() == held and cached("sk-alice") == 32  # bob changed nothing
    with pytest.raises(openai.AuthenticationError):  # the admin key is nobody's tenant key
        sdk(keyed, ADMIN).completions.create(model=tiny_model.name, prompt=prompt, max_tokens=2)

    assert reset(ADMIN).status_code == 200
    assert cached_blocks() == 0  # every tenant's blocks, alice's among them
    on_engine(keyed, lambda engine: engine.cache.check_integrity())
    assert [cached("sk-alice"), cached("sk-alice")] == [0, 32]
    on_engine(keyed, lambda engine: engine.cache.check_integrity())
    assert on_engine(keyed, lambda engine: engine.cache.allocator.num_used) == 0


def test_the_admin_key_is_its_own():
    assert not Tenants().guards_admin  # an open server: admin routes open, as vLLM's dev mode
    assert Tenants(admin_key="sk-admin").guards_admin and not Tenants(admin_key="sk-x").required
    assert KEYS.is_admin("Bearer sk-admin") and not KEYS.is_admin("Bearer sk-alice")
    assert not KEYS.is_admin(None) and KEYS.authenticate("Bearer sk-admin") is None
    with pytest.raises(ValueError, match="must differ from every tenant's API key"):
        Tenants((("sk-alice", "alice"),), admin_key="sk-alice")
    with pytest.raises(ValueError, match="--admin-api-key must be a non-empty string"):
        Tenants.from_flags(admin_key=" ")


def test_the_audit_finds_a_cross_tenant_hit_when_salts_are_ignored(tiny_model, monkeypatch):
    """A mutation the audit must catch: a prefix index that drops the salt."""

    def found(mutated: bool) -> dict:
        if mutated:
            keys = HashPrefixIndex.keys
            monkeypatch.setattr(HashPrefixIndex, "keys", lambda self, t, salt: keys(self, t, None))
        engine = kvlab.Engine(tiny_model, engine_config("paged+prefix", max_model_len=256))
        audit = TenantAudit().install(engine)
        params = kvlab.SamplingParams(max_new_tokens=2)
        for tenant in ("alice", "bob"):
            engine.add_request(PROMPT, params, salt=engine_salt(tenant, None))
            while engine.has_unfinished():
                engine.step()
        return audit.summary()

    assert found(mutated=False)["cross_tenant_hits"] == 0
    assert found(mutated=True)["cross_tenant_hits"] == 2  # bob hit alice's two full blocks


def test_a_tenant_past_its_places_and_queue_gets_429_and_others_go_on(tiny_model):
    limits = ServeLimits(tenant_max_running=1, tenant_max_queued=1, retry_after_s=3)
    engine = kvlab.Engine(tiny_model, engine_config("paged+prefix", max_model_len=256))
    long = {"prompt": [7, 8, 9], "max_tokens": 250, "ignore_eos": True, "stream": True}
    # The engine takes no step until the test has seen alice's second request queued and her
    # third refused: her first request holds its place however fast the machine decodes.
    go = threading.Event()
    engine.observers.subscribe("before_schedule", lambda: go.wait(timeout=60))
    with ServerThread(engine, tenants=KEYS, limits=limits) as server:
        url = f"{server.url}/v1/completions"

        async def flood_and_one():
            alice = httpx.AsyncClient(timeout=60, headers={"Authorization": "Bearer sk-alice"})
            bob = httpx.AsyncClient(timeout=60, headers={"Authorization": "Bearer sk-bob"})
            async with alice, bob:
                first = asyncio.ensure_future(alice.post(url, json=long))
                second = asyncio.ensure_future(alice.post(url, json=long))
                waiting, deadline = "kvlab:tenant_requests_queued{tenant=alice,}", time.time() + 30
                while scrape(server, "kvlab:tenant_requests_queued").get(waiting) != 1:
                    assert time.time() < deadline, "alice's second request never queued"
                    await asyncio.sleep(0.01)  # alice's first request runs, her second waits
                third = await alice.post(url, json=long)
                go.set()
                answer = await bob.post(url, json={**long, "max_tokens": 2, "stream": False})
                firsts = [r.status_code for r in await asyncio.gather(first, second)]
                return third, answer, firsts

        third, answer, firsts = asyncio.run(flood_and_one())
        queued = scrape(server, "kvlab:tenant_requests")
    assert third.status_code == 429 and third.headers["Retry-After"] == "3"
    assert "--tenant-max-queued=1" in third.json()["error"]["message"]
    assert answer.status_code == 200 and firsts == [200, 200]
    assert queued["kvlab:tenant_requests_total{tenant=alice,busy}"] == 1
    assert queued["kvlab:tenant_requests_total{tenant=bob,length}"] == 1


def test_the_gate_counts_exactly_at_every_await():
    """Requests that arrive together: one holds the place, one waits, the next is refused;
    a leaving request hands its place straight to the waiter, and a waiter that leaves
    frees its spot in the queue (the counts never include a request in two states)."""
    from kvlab.serve.gate import TenantGate, TooBusy

    async def play():
        gate = TenantGate(ServeLimits(tenant_max_running=1, tenant_max_queued=1))
        never = asyncio.get_running_loop().create_future()
        first = asyncio.ensure_future(gate.enter("a", never))
        waiter = asyncio.ensure_future(gate.enter("a", never))
        for _ in range(3):  # both run to their first await, and their wake-ups run
            await asyncio.sleep(0)
        assert (gate.running["a"], gate.queued["a"]) == (1, 1)
        with pytest.raises(TooBusy, match="tenant-max-queued=1"):
            await gate.enter("a", never)
        (await first).release()
        assert (gate.running["a"], gate.queued["a"]) == (1, 0)  # handed on, not re-counted
        (await waiter).release()
        assert (gate.running["a"], gate.queued["a"]) == (0, 0)
        left = asyncio.get_running_loop().create_future()
        held = await gate.enter("a", never)
        leaving = asyncio.ensure_future(gate.enter("a", left))
        await asyncio.sleep(0)
        left.set_result(None)
        assert await leaving is None and (gate.running["a"], gate.queued["a"]) == (1, 0)
        held.release()
        assert (gate.running["a"], gate.queued["a"]) == (0, 0)

    asyncio.run(play())


def test_serve_command_refuses_a_bad_keys_file_before_loading_a_model(tmp_path):
    table = tmp_path / "keys.json"
    table.write_text('["not", "an", "object"]')
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    bad = subprocess.run(
        [sys.executable, "-m", "kvlab", "serve", "--api-keys-file", str(table)],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2 and "must be a JSON object" in bad.stderr
