"""KV events: what the cache reports (kvlab.cache.events) and what kvlab serve publishes
over ZMQ (kvlab.serve.kv_events), on the tiny model.

- The events tell the whole story: replaying them gives exactly the hash index's
  contents at every point, and each BlockStored can be checked by a consumer alone (its
  hashes follow from its parent, token ids and extra keys).
- Over real HTTP and real ZMQ: a subscriber (kvlab.route's, with the replay endpoint)
  ends with the engine's index, block for block; /reset_prefix_cache reaches it as
  AllBlocksCleared.
"""

from __future__ import annotations

import random

import httpx
import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgpack")
pytest.importorskip("cbor2")
pytest.importorskip("fastapi")

import kvlab  # noqa: E402
from kvlab.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, EventLog  # noqa: E402
from kvlab.cache.prefix.hash import VLLM_NONE_HASH_SEED, block_hashes, sha256_cbor  # noqa: E402
from kvlab.config import EngineConfig, SamplingParams  # noqa: E402
from kvlab.route.events import EventSubscriber  # noqa: E402
from kvlab.route.index import BlockIndex  # noqa: E402
from kvlab.serve import ServerThread  # noqa: E402
from kvlab.serve.kv_events import KVEventPublisher, KVEventsConfig, external_hash  # noqa: E402

BLOCK = 16


def config(**fields) -> EngineConfig:
    base = dict(cache="paged", prefix_caching="hash", block_size=BLOCK,
                prefix_caching_hash_algo="sha256_cbor", kv_budget_tokens=BLOCK * 24)  # fmt: skip
    return EngineConfig(**{**base, **fields})


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts sharing prefixes (a few stems, varied tails) so blocks are hit, stored,
    evicted and stored again."""
    rng = random.Random(seed)
    stems = [[rng.randrange(100, 4000) for _ in range(rng.choice([20, 40, 70]))] for _ in range(4)]
    return [rng.choice(stems) + [rng.randrange(100, 4000) for _ in range(rng.randrange(1, 40))]
            for _ in range(n)]  # fmt: skip


def replay(events, live: set[bytes]) -> None:
    for event in events:
        if isinstance(event, BlockStored):
            assert not live & set(event.block_hashes), "a block stored twice without removal"
            live.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            assert set(event.block_hashes) <= live, "a removal of a block never stored"
            live.difference_update(event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            live.clear()


def test_events_replay_to_the_index_at_every_step(tiny_model):
    """Under eviction pressure (24 blocks, prompts sharing stems), replaying the events
    after every step gives the hash index's keys exactly; each BlockStored's hashes follow
    from its own fields, as a consumer computes them."""
    log = EventLog()
    engine = kvlab.Engine(tiny_model, config(), kv_events=log)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    for ids in prompts(24):
        engine.add_request(ids, params, salt=random.Random(len(ids)).choice([None, "t1"]))
    live: set[bytes] = set()
    kinds = set()
    while engine.has_unfinished():
        engine.step()
        events = log.take()
        kinds |= {type(e).__name__ for e in events}
        replay(events, live)
        assert live == set(engine.cache.index.block_of)
        for event in events:
            if isinstance(event, BlockStored):
                parent = event.parent_block_hash or sha256_cbor(VLLM_NONE_HASH_SEED)
                for i, h in enumerate(event.block_hashes):
                    chunk = tuple(event.token_ids[i * BLOCK : (i + 1) * BLOCK])
                    extra = event.extra_keys[i]
                    extra = None if extra is None else (("cache_salt", extra[0]),)
                    assert sha256_cbor((parent, chunk, extra)) == h
                    parent = h
    engine.cache.check_integrity()
    assert kinds == {"BlockStored", "BlockRemoved"}
    assert engine.cache.allocator.evictions > 0
    assert engine.cache.reset_prefix_cache()
    assert log.take() == [AllBlocksCleared()] and not engine.cache.index.block_of
    engine.cache.check_integrity()


def test_stored_hashes_are_the_requests_block_hashes(tiny_model):
    """A request's prompt and output blocks are reported under the hashes a router
    computes from its token ids alone (the last token's K/V is never computed)."""
    log = EventLog()
    engine = kvlab.Engine(tiny_model, config(kv_budget_tokens=BLOCK * 64), kv_events=log)
    ids = prompts(1, seed=3)[0] + list(range(200, 240))
    out = engine.generate([ids], SamplingParams(max_new_tokens=33, ignore_eos=True))[0]
    stored = [h for e in log.take() if isinstance(e, BlockStored) for h in e.block_hashes]
    tokens = ids + list(out.token_ids)
    assert stored == block_hashes(tokens[:-1], BLOCK)


def test_blake2b_keys_are_unchanged_and_seeds_split_caches(tiny_model):
    """The default keys are kvlab's as before; a seed changes every key (replicas seeded
    differently share no hash)."""
    import hashlib

    import numpy as np

    tokens = list(range(40))
    parent, keys = b"", []
    for start in (0, 16):
        digest = hashlib.blake2b(parent, digest_size=16)
        digest.update(np.asarray(tokens[start : start + 16], dtype=np.int64).tobytes())
        digest.update(b"salt:t")
        parent = digest.digest()
        keys.append(parent)
    assert block_hashes(tokens, 16, "t", algo="blake2b") == keys
    assert not set(block_hashes(tokens, 16, "t", algo="blake2b", seed="x")) & set(keys)
    assert not set(block_hashes(tokens, 16, seed="x")) & set(block_hashes(tokens, 16))
    with pytest.raises(ValueError, match="prefix_caching_hash_algo"):
        EngineConfig(prefix_caching_hash_algo="md5")
    with pytest.raises(ValueError, match="need prefix_caching='hash'"):
        EngineConfig(cache="paged", prefix_caching="radix", prefix_caching_hash_algo="sha256_cbor")
    with pytest.raises(ValueError, match="KV events need"):
        kvlab.Engine(tiny_model, EngineConfig(cache="paged"), kv_events=EventLog())


def test_kv_events_config_is_vllms():
    parsed = KVEventsConfig.from_json('{"enable_kv_cache_events": true, "topic": "kv"}')
    assert (parsed.publisher, parsed.endpoint, parsed.enabled) == ("zmq", "tcp://*:5557", True)
    assert not KVEventsConfig.from_json('{"enable_kv_cache_events": false}').enabled
    with pytest.raises(ValueError, match="unknown keys"):
        KVEventsConfig.from_json('{"enable_kv_cache_events": true, "port": 1}')
    with pytest.raises(ValueError, match="publisher"):
        KVEventsConfig(enable_kv_cache_events=True, publisher="kafka")


def test_serve_publishes_over_zmq_what_the_engine_holds(tiny_model):
    """kvlab serve with a publisher on free ports; a subscriber that joins late catches up
    through the replay endpoint and ends with the engine's index, hash for hash (as the
    integers vLLM's events carry); a reset reaches it as AllBlocksCleared."""
    kv = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:0",
                        replay_endpoint="tcp://*:0", topic="kvlab")  # fmt: skip
    publisher = KVEventPublisher(kv)
    engine = kvlab.Engine(tiny_model, config(), kv_events=publisher)
    index = BlockIndex()
    with ServerThread(engine, kv_events=publisher) as server:
        body = {"model": tiny_model.name, "max_tokens": 8, "ignore_eos": True, "temperature": 0}
        for ids in prompts(6, seed=1):  # before anyone subscribes
            assert httpx.post(server.url + "/v1/completions", json={**body, "prompt": ids},
                              timeout=60).status_code == 200  # fmt: skip
        subscriber = EventSubscriber(index.apply)
        subscriber.add("r0", publisher.endpoint, publisher.replay_endpoint, topic="kvlab")
        with subscriber:
            for ids in prompts(12, seed=2):
                answer = httpx.post(
                    server.url + "/v1/completions",
                    json={**body, "prompt": ids, "cache_salt": "t1"},
                    timeout=60,
                )
                assert answer.status_code == 200  # fmt: skip
            subscriber.wait_quiet()
            held = server.loop.call(lambda e: set(e.cache.index.block_of)).result(10)
            assert index.blocks["r0"] == {external_hash(k) for k in held}
            assert index.block_size["r0"] == BLOCK
            assert index.counts["r0", "BlockRemoved"] > 0
            assert httpx.post(server.url + "/reset_prefix_cache", timeout=30).status_code == 200
            subscriber.wait_quiet()
            assert index.counts["r0", "AllBlocksCleared"] == 1 and not index.blocks["r0"]
            assert subscriber.feeds["r0"].gaps == 0
        assert publisher.batches == subscriber.feeds["r0"].batches
