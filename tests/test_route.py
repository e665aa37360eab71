"""kvlab route: the block index, the policies, and the router over real HTTP in front of
replicas publishing real KV events over ZMQ (tiny-model engines in threads; one test
starts and stops real `kvlab serve` processes)."""

from __future__ import annotations

import os
import random

import httpx
import pytest

pytest.importorskip("zmq")
pytest.importorskip("fastapi")

import kvlab  # noqa: E402
from kvlab.config import EngineConfig  # noqa: E402
from kvlab.route.hashing import char_block_hashes, token_block_hashes  # noqa: E402
from kvlab.route.index import BlockIndex  # noqa: E402
from kvlab.route.policies import POLICIES, Replica, RoutedRequest  # noqa: E402
from kvlab.route.replicas import ServeReplicas  # noqa: E402
from kvlab.route.router import Backend, Router  # noqa: E402
from kvlab.route.server import RouterThread  # noqa: E402
from kvlab.serve import ServerThread  # noqa: E402
from kvlab.serve.kv_events import KVEventPublisher, KVEventsConfig, external_hash  # noqa: E402

BLOCK = 16


def stored(hashes, tokens, size=BLOCK, parent=None) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": size}  # fmt: skip


def test_index_keeps_what_events_say():
    index = BlockIndex()
    index.apply("a", stored([1, 2, 3], list(range(48))))
    index.apply("b", stored([1, 2], list(range(32))))
    index.apply("b", stored([9], list(range(16)), parent=2))
    assert index.longest_prefix([1, 2, 3, 4], ["a", "b"]) == {"a": 3, "b": 2}
    index.apply("a", {"type": "BlockRemoved", "block_hashes": [2]})
    assert index.longest_prefix([1, 2, 3], ["a", "b"]) == {"a": 1, "b": 2}  # a gap stops a
    assert index.info[9].parent == 2 and index.info[1].tokens == tuple(range(16))
    index.apply("b", {"type": "AllBlocksCleared"})
    assert index.longest_prefix([1, 2], ["a", "b"]) == {"a": 1, "b": 0}
    assert index.holders == {1: {"a"}, 3: {"a"}} and index.size("b") == 0


def test_prefix_policies_with_the_load_guard():
    index = BlockIndex()
    tokens = list(range(1000, 1100))
    hashes = token_block_hashes(tokens, BLOCK)
    index.apply("r0", stored(hashes[:5], tokens[: 5 * BLOCK]))
    index.apply("r1", stored(hashes[:2], tokens[: 2 * BLOCK]))
    replicas = [Replica("r0", "u0"), Replica("r1", "u1"), Replica("r2", "u2")]
    precise = POLICIES["precise"](index=index, load_guard=2)
    request = RoutedRequest("", tokens)
    decision = precise.choose(request, replicas)
    assert (decision.replica, decision.reason) == ("r0", "5/6 blocks cached")
    assert decision.scores == {"r0": 5.0, "r1": 2.0, "r2": 0.0}
    replicas[0].in_flight = 3  # more than 2 busier than r2 (0): r0 may not compete
    decision = precise.choose(request, replicas)
    assert decision.replica == "r1" and "load guard" in decision.reason
    replicas[1].in_flight = 3
    assert precise.choose(request, replicas).replica == "r2"
    # a router computing another block size (or seed) than the replicas finds nothing
    other = POLICIES["precise"](index=index, block_size=32, load_guard=9)
    assert other.choose(request, replicas).reason == "no blocks cached: least loaded"
    seeded = POLICIES["precise"](index=index, hash_seed="0", load_guard=9)
    assert seeded.choose(request, replicas).scores["r0"] == 0
    # approximate: what it sent where, by 64-character blocks
    approx = POLICIES["approx-prefix"](load_guard=9)
    text = "the same long document " * 20
    fresh = [Replica("a", "u"), Replica("b", "u")]
    first = approx.choose(RoutedRequest(text), fresh)
    approx.routed(RoutedRequest(text), next(r for r in fresh if r.name == first.replica))
    fresh[0].routed = fresh[1].routed = 5
    again = approx.choose(RoutedRequest(text + " and a question"), fresh)
    assert again.replica == first.replica and again.scores[first.replica] == len(
        char_block_hashes(text)
    )
    with pytest.raises(ValueError, match="unknown"):
        Router([Backend("http://x")], policy="random")


@pytest.fixture
def fleet(tiny_model):
    """Two tiny engines behind real HTTP, each publishing KV events on free ports."""
    servers, backends = [], []
    try:
        for i in range(2):
            kv = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:0",
                                replay_endpoint="tcp://*:0")  # fmt: skip
            publisher = KVEventPublisher(kv)
            config = EngineConfig(cache="paged", prefix_caching="hash", block_size=BLOCK,
                                  prefix_caching_hash_algo="sha256_cbor",
                                  kv_budget_tokens=BLOCK * 64)  # fmt: skip
            engine = kvlab.Engine(tiny_model, config, kv_events=publisher)
            servers.append(ServerThread(engine, kv_events=publisher).start())
            backends.append(Backend(servers[-1].url, publisher.endpoint,
                                    publisher.replay_endpoint, name=f"r{i}"))  # fmt: skip
        yield servers, backends
    finally:
        for server in servers:
            server.stop()


def complete(url: str, body: dict) -> httpx.Response:
    answer = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer


def test_precise_routes_to_the_replica_holding_the_prefix(tiny_model, fleet):
    servers, backends = fleet
    rng = random.Random(5)
    docs = [[rng.randrange(100, 9000) for _ in range(90)] for _ in range(2)]
    router = Router(backends, policy="precise", tokenizer=tiny_model.tokenizer)
    with RouterThread(router) as front:
        body = {"model": tiny_model.name, "max_tokens": 4, "ignore_eos": True, "temperature": 0}
        first = [
            complete(front.url, {**body, "prompt": d}).headers["x-kvlab-replica"] for d in docs
        ]
        assert sorted(first) == ["r0", "r1"]  # nothing cached: the least loaded, in turn
        router.subscriber.wait_quiet()
        for doc, home in zip(docs, first):
            answer = complete(front.url, {**body, "prompt": doc + [7, 8, 9, 10] * 5})
            assert answer.headers["x-kvlab-replica"] == home
            assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 80
        decisions = httpx.get(front.url + "/router/decisions?since=2").json()
        assert [d["reason"] for d in decisions] == ["5/6 blocks cached"] * 2
        # the router's index is the engines' own, block for block
        router.subscriber.wait_quiet()
        for server, backend in zip(servers, backends):
            held = server.loop.call(lambda e: set(e.cache.index.block_of)).result(10)
            assert router.index.blocks[backend.name] == {external_hash(k) for k in held}
        # chat: the router applies the chat template as the replicas do
        story = [{"role": "user", "content": "A long story about the sea " * 8}]
        chat = {"model": tiny_model.name, "max_tokens": 4, "temperature": 0, "messages": story}
        home = httpx.post(front.url + "/v1/chat/completions", json=chat, timeout=120)
        router.subscriber.wait_quiet()
        chat["messages"] += [{"role": "assistant", "content": "Yes."},
                             {"role": "user", "content": "And then?"}]  # fmt: skip
        again = httpx.post(front.url + "/v1/chat/completions", json=chat, timeout=120)
        assert again.headers["x-kvlab-replica"] == home.headers["x-kvlab-replica"]
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= BLOCK
        # switching policy, and the router's own series
        assert httpx.post(front.url + "/router/policy", json={"policy": "round-robin"}).is_success
        turns = [complete(front.url, {**body, "prompt": docs[0]}).headers["x-kvlab-replica"]
                 for _ in range(2)]  # fmt: skip
        assert sorted(turns) == ["r0", "r1"]
        assert httpx.post(front.url + "/router/policy", json={"policy": "x"}).status_code == 400
        page = httpx.get(front.url + "/metrics").text
        assert 'kvlab_route_requests_total{replica="r0"}' in page
        assert httpx.get(front.url + "/v1/models").json()["data"][0]["id"] == tiny_model.name
        state = httpx.get(front.url + "/router/state").json()
        assert all(f["gaps"] == 0 for f in state["events"].values())
        assert sum(r["in_flight"] for r in state["replicas"]) == 0


def test_serve_replicas_are_processes_started_and_stopped(tiny_model_path, tiny_model):
    """Two `kvlab serve` processes publishing events, a request through the router, and
    nothing left running afterwards."""
    replicas = ServeReplicas(2, model=str(tiny_model_path), budget="2048tok")
    with replicas:
        pids = [r.process.pid for r in replicas.replicas]
        router = Router(replicas.backends(), policy="precise", tokenizer=tiny_model.tokenizer)
        with RouterThread(router) as front:
            body = {"model": tiny_model.name, "prompt": list(range(100, 170)), "max_tokens": 2}
            complete(front.url, body)
            router.subscriber.wait_quiet()
            assert sum(router.index.size(b.name) for b in replicas.backends()) == 4
            replicas.reset_prefix_caches()
            router.subscriber.wait_quiet()
            assert sum(router.index.size(b.name) for b in replicas.backends()) == 0
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_chats_through_the_router_come_home(tiny_model, fleet):
    """Multi-turn chats (kvlab.route.sessions), as chat messages and as token ids: each
    session's later turns go to the replica holding it and hit its cache; the router logs
    each request's user; the summary counts what the replicas reported."""
    from kvlab.route.sessions import run_chats, summary, tenant_sessions

    _, backends = fleet
    sessions = tenant_sessions(3, turns=2, tenants=2, max_doc_chars=600)
    router = Router(backends, policy="precise", tokenizer=tiny_model.tokenizer)
    with RouterThread(router) as front:
        for tokenizer in (None, tiny_model.tokenizer):
            router.reset_counts()
            for backend in backends:
                httpx.post(backend.url + "/reset_prefix_cache", timeout=30).raise_for_status()
            router.subscriber.wait_quiet()
            turns = run_chats(front.url, tiny_model.name, sessions, max_tokens=3, concurrency=1,
                              tokenizer=tokenizer)  # fmt: skip
            assert len(turns) == 6 and {t.turn for t in turns} == {0, 1}
            home = {t.session_id: t.replica for t in turns if t.turn == 0}
            for t in turns:
                assert t.replica == home[t.session_id]
                if t.turn == 1:
                    assert t.cached_tokens >= t.prompt_tokens // 2
            users = [d["user"] for d in router.decisions]
            assert sorted(users) == sorted(t.session_id for t in turns)
            row = summary(turns, 1.0, ["r0", "r1"])
            assert row["turns"] == 6 and row["later_turn_hit_rate"] > 0.5
            assert sum(row["requests_per_replica"].values()) == 6
