"""kvlab serve's KV events against `vllm serve`'s, on the same workload: one subscriber
(kvlab.route.events) reads both streams, and the stored and removed blocks must be the
same, in the same order.

Both sides: the tiny model in a shape vLLM's CPU build serves (tests/bench_scripts.py:
the embedded tokenizer, 2 layers, head size 32; events depend on token ids, and the tiny
model makes vLLM's start and each step cheap), fp32, greedy,
block size 32 (vLLM's CPU build takes multiples of 32 only), prefix caching with
sha256_cbor hashes and vLLM's default NONE_HASH seed, and the same usable KV: vLLM's
`--kv-cache-memory-bytes` buys N blocks of which it keeps one back (its null block), so
kvlab gets N - 1 blocks. Requests go one at a time (each waits for the previous answer),
token-id prompts sharing stems, some with a cache_salt, each `max_tokens` with
ignore_eos: the budget fills, cached blocks are hit, evicted and stored again.

Compared per block, in order: every stored block (its hash, its parent's hash, its token
ids, its extra keys) and every removed hash. Differences this workload avoids, and why
(docs/design/replicas.md says more):
- vLLM reports a block again when two requests compute the same block in the same step
  (its pool keeps duplicates); kvlab indexes the first and reports it once. One request
  at a time never computes a block twice.
- Decode blocks hold generated tokens: equal only while both generate the same greedy
  tokens, which the test checks first (fp32 on the same token ids; DESIGN.md: identical
  on 40 of 40 prompts).
- Batch boundaries (which events share a KVEventBatch) follow each engine's steps; the
  comparison flattens them.

`vllm serve` takes about a minute to start here; kvlab's side runs meanwhile. Skips, saying
why, where vLLM's venv is missing.
"""

from __future__ import annotations

import json
import random
import threading
import time

import httpx
import pytest

pytest.importorskip("zmq")
pytest.importorskip("fastapi")

from bench_scripts import vllm_tiny_checkpoint  # noqa: E402

import kvlab  # noqa: E402
from kvlab.checks.vllm_oracle import block_bytes  # noqa: E402
from kvlab.config import EngineConfig  # noqa: E402
from kvlab.peers.vllm_peer import model_path, vllm_missing  # noqa: E402
from kvlab.peers.vllm_serve import server_process, vllm_env, vllm_serve_argv  # noqa: E402
from kvlab.route.events import EventSubscriber  # noqa: E402
from kvlab.route.replicas import free_port  # noqa: E402
from kvlab.serve import ServerThread  # noqa: E402
from kvlab.serve.kv_events import KVEventPublisher, KVEventsConfig  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(bool(vllm_missing()), reason=str(vllm_missing())),
]
BLOCK, USABLE_BLOCKS, MAX_TOKENS = 32, 20, 40
MAX_MODEL_LEN = 512  # vLLM refuses to start unless one request this long fits its KV


def workload(n: int = 9) -> list[dict]:
    """One-at-a-time completions: 3 stems of 2-5 blocks, tails of 5-60 tokens, every
    third with a cache_salt."""
    rng = random.Random(14)
    stems = [[rng.randrange(300, 40000) for _ in range(BLOCK * k + 7)] for k in (2, 3, 5)]
    requests = []
    for i in range(n):
        prompt = rng.choice(stems) + [
            rng.randrange(300, 40000) for _ in range(rng.randrange(5, 60))
        ]
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}
        if i % 3 == 2:
            body["cache_salt"] = "tenant-b"
        requests.append(body)
    return requests


def send_all(url: str, model: str, requests: list[dict]) -> list[list[int] | str]:
    texts = []
    for body in requests:
        answer = httpx.post(f"{url}/v1/completions", json={**body, "model": model}, timeout=600)
        assert answer.status_code == 200, answer.text[:500]
        texts.append(answer.json()["choices"][0]["text"])
    return texts


def blocks(events: list[dict]) -> tuple[list[tuple], list[int]]:
    """Stored blocks (hash, parent, tokens, extra keys) and removed hashes, in order."""
    stored, removed = [], []
    for event in events:
        if event["type"] == "BlockStored":
            parent, size = event["parent_block_hash"], event["block_size"]
            for i, h in enumerate(event["block_hashes"]):
                tokens = tuple(event["token_ids"][i * size : (i + 1) * size])
                extra = event.get("extra_keys")
                extra = None if extra is None or extra[i] is None else tuple(extra[i])
                stored.append((h, parent, tokens, extra))
                parent = h
        elif event["type"] == "BlockRemoved":
            removed += event["block_hashes"]
    return stored, removed


def collector(streams: dict[str, list[dict]]):
    lock = threading.Lock()

    def on_event(name: str, event: dict) -> None:
        with lock:
            streams.setdefault(name, []).append(event)

    return on_event


def test_kvlab_and_vllm_serve_publish_the_same_blocks(model, tmp_path):
    model = kvlab.load_model(str(vllm_tiny_checkpoint(tmp_path / "tiny", model.tokenizer)))
    requests = workload()
    streams: dict[str, list[dict]] = {}
    subscriber = EventSubscriber(collector(streams))
    vllm_port, vllm_events = free_port(), free_port()
    kv_cache_bytes = (USABLE_BLOCKS + 1) * block_bytes(model)
    argv = vllm_serve_argv(
        model_path(model), vllm_port, kv_cache_bytes, MAX_MODEL_LEN,
        block_size=BLOCK, max_num_seqs=4, max_num_batched_tokens=2048, enforce_eager=True,
    )  # fmt: skip
    argv += [
        "--prefix-caching-hash-algo=sha256_cbor",
        "--kv-events-config=" + json.dumps({
            "enable_kv_cache_events": True, "publisher": "zmq",
            "endpoint": f"tcp://*:{vllm_events}", "topic": "kv",
        }),
    ]  # fmt: skip
    env = vllm_env(VLLM_CPU_OMP_THREADS_BIND="0")
    env.pop("PYTHONHASHSEED", None)  # vLLM's default seed, "vllm-none-hash"
    subscriber.add("vllm", f"tcp://127.0.0.1:{vllm_events}", topic="kv")

    kv = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:0",
                        replay_endpoint="tcp://*:0", topic="kv")  # fmt: skip
    publisher = KVEventPublisher(kv)
    config = EngineConfig(
        cache="paged", prefix_caching="hash", prefix_caching_hash_algo="sha256_cbor",
        block_size=BLOCK, kv_budget_tokens=USABLE_BLOCKS * BLOCK, max_model_len=MAX_MODEL_LEN,
        max_num_seqs=4, max_num_batched_tokens=2048,
    )  # fmt: skip
    engine = kvlab.Engine(model, config, kv_events=publisher)
    subscriber.add("kvlab", publisher.endpoint, publisher.replay_endpoint, topic="kv")
    url = f"http://127.0.0.1:{vllm_port}"
    ours: list = []

    def kvlab_side() -> None:  # while vLLM starts
        with ServerThread(engine, kv_events=publisher) as server:
            ours.extend(send_all(server.url, model.name, requests))

    with subscriber:
        kvlab_thread = threading.Thread(target=kvlab_side)
        kvlab_thread.start()
        try:
            with server_process(argv, url, tmp_path / "vllm_serve.log", env=env, timeout_s=900):
                kvlab_thread.join()
                started = time.monotonic()
                served = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
                theirs = send_all(url, served, requests)
                subscriber.wait_quiet(quiet_s=1.0)
                vllm_s = time.monotonic() - started
        finally:
            kvlab_thread.join()
    assert len(ours) == len(requests)
    assert ours == theirs, "greedy outputs differ: decode blocks cannot match"
    ours_stored, ours_removed = blocks(streams["kvlab"])
    theirs_stored, theirs_removed = blocks(streams["vllm"])
    assert len(theirs_removed) > 0, "the workload never evicted: it tests too little"
    assert any(s[3] is not None for s in theirs_stored), "no salted block was stored"
    assert ours_stored == theirs_stored
    assert ours_removed == theirs_removed
    assert {e["type"] for e in streams["vllm"]} == {e["type"] for e in streams["kvlab"]}
    print(f"{len(ours_stored)} stored, {len(ours_removed)} removed, equal; vLLM ran {vllm_s:.0f} s")
