"""`kvlab serve` driven by a client nobody here wrote (the `openai` SDK) and by raw HTTP.

Servers run in a thread on a free loopback port. The tiny model serves where tokens do not
matter (batching, bad input, disconnects, metrics), the real model where they do (its
chat answer, seeded samples against an in-process engine).
"""

from __future__ import annotations

import asyncio
import os
import signal
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
from kvlab.peers.vllm_serve import wait_healthy  # noqa: E402
from kvlab.serve import ServerThread, engine_config  # noqa: E402
from kvlab.serve.server import free_socket  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VLLM_PAGE = Path(__file__).with_name("data") / "vllm_serve_metrics.txt"
QUESTION = "What is the capital of France?"


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def on_engine(server, fn):
    """fn(engine) on the engine loop thread (the engine is not thread-safe)."""
    return server.loop.call(fn).result(timeout=30)


def wait_idle(server, timeout_s: float = 20.0) -> None:
    """Until the engine has nothing unfinished and holds no block."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        busy = on_engine(server, lambda e: e.has_unfinished() or e.cache.allocator.num_used)
        if not busy:
            return
        time.sleep(0.05)
    raise AssertionError("the engine did not go idle")


def check_clean(server) -> None:
    wait_idle(server)
    on_engine(server, lambda e: e.cache.check_integrity())
    assert on_engine(server, lambda e: e.cache.allocator.num_used) == 0


def scrape(server) -> dict[str, float]:
    """{series{labels}: value} of the server's /metrics page."""
    from prometheus_client.parser import text_string_to_metric_families

    page = httpx.get(f"{server.url}/metrics").text
    values = {}
    for family in text_string_to_metric_families(page):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            values[f"{s.name}{{{labels}}}"] = s.value
    return values


@pytest.fixture(scope="module")
def real_server(model):
    config = engine_config("paged+prefix", max_model_len=1024, kv_budget_tokens=8192)
    with ServerThread(kvlab.Engine(model, config)) as server:
        yield server


@pytest.fixture(scope="module")
def tiny_server(tiny_model):
    config = engine_config("paged+prefix", max_model_len=512, kv_budget_tokens=4096)
    with ServerThread(kvlab.Engine(tiny_model, config)) as server:
        yield server


@pytest.fixture()
def tight_server(tiny_model):
    """16 blocks of 16 tokens: a request of more than 256 tokens can never be held."""
    config = engine_config("paged+prefix", max_model_len=512, kv_budget_tokens=256)
    with ServerThread(kvlab.Engine(tiny_model, config)) as server:
        yield server


# --- the openai SDK on the real model ---------------------------------------------------
def test_chat_answer_streamed_and_not(real_server, model):
    sdk, messages = client(real_server), [{"role": "user", "content": QUESTION}]
    reply = sdk.chat.completions.create(
        model=model.name, messages=messages, max_tokens=24, temperature=0
    )
    answer = reply.choices[0].message.content
    assert answer == "The capital of France is Paris."
    assert reply.choices[0].finish_reason == "stop"  # EOS
    engine = kvlab.Engine(model, engine_config("paged+prefix", max_model_len=1024))
    solo = engine.generate([QUESTION], kvlab.SamplingParams(max_new_tokens=24))[0]
    assert answer == solo.text
    assert reply.usage.prompt_tokens == len(solo.prompt_token_ids)
    assert reply.usage.completion_tokens == len(solo.token_ids)

    pieces, finish = [], None
    stream = sdk.chat.completions.create(
        model=model.name, messages=messages, max_tokens=24, temperature=0, stream=True
    )
    for chunk in stream:
        pieces.append(chunk.choices[0].delta.content or "")
        finish = chunk.choices[0].finish_reason or finish
    assert "".join(pieces) == answer and finish == "stop"
    check_clean(real_server)


def test_completions_seeded_samples_match_the_engine(real_server, model):
    sdk, prompt = client(real_server), "Once upon a time, in a small village,"
    options = dict(model=model.name, max_tokens=12, n=3, temperature=0.9, seed=7)
    reply = sdk.completions.create(prompt=prompt, **options)
    texts = [c.text for c in sorted(reply.choices, key=lambda c: c.index)]
    engine = kvlab.Engine(model, engine_config("paged+prefix", max_model_len=1024))
    params = kvlab.SamplingParams(max_new_tokens=12, n=3, temperature=0.9, seed=7)
    solo = engine.generate([prompt], params, chat=False)[0]
    assert texts == [s.text for s in solo.samples]
    assert len(set(texts)) > 1  # three different samples, each reproducible by its seed
    assert reply.usage.completion_tokens == sum(len(s.token_ids) for s in solo.samples)

    streamed = ["", "", ""]
    for chunk in sdk.completions.create(prompt=prompt, stream=True, **options):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == texts
    by_ids = sdk.completions.create(prompt=solo.prompt_token_ids, **options)
    assert [c.text for c in sorted(by_ids.choices, key=lambda c: c.index)] == texts
    check_clean(real_server)


def test_stop_string_ends_the_answer_and_frees_its_blocks(real_server, model):
    sdk, messages = client(real_server), [{"role": "user", "content": QUESTION}]
    reply = sdk.chat.completions.create(
        model=model.name, messages=messages, max_tokens=24, temperature=0, stop=["Paris"]
    )
    assert reply.choices[0].message.content == "The capital of France is "
    assert reply.choices[0].finish_reason == "stop"
    text = ""
    for chunk in sdk.chat.completions.create(
        model=model.name, messages=messages, max_tokens=24, temperature=0, stop=[" Paris"],
        stream=True,
    ):  # fmt: skip
        text += chunk.choices[0].delta.content or ""
    assert text == "The capital of France is"
    check_clean(real_server)


# --- the tiny model: batching, bad input, disconnects -----------------------------------
def test_models_and_health(tiny_server, tiny_model):
    assert [m.id for m in client(tiny_server).models.list()] == [tiny_model.name]
    assert httpx.get(f"{tiny_server.url}/health").status_code == 200


def test_concurrent_requests_batch_and_match_solo_runs(tiny_server, tiny_model):
    prompts = [[100 + 7 * i + j for j in range(5 + 9 * i)] for i in range(8)]
    lengths = [24 + 3 * i for i in range(8)]
    sdk = openai.AsyncOpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused", max_retries=0)

    async def one(ids, n):
        reply = await sdk.completions.create(
            model=tiny_model.name, prompt=ids, max_tokens=n, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        return reply.choices[0].text, reply.usage.completion_tokens

    async def everyone():
        return await asyncio.gather(*(one(p, n) for p, n in zip(prompts, lengths)))

    on_engine(tiny_server, lambda e: e.telemetry.records.clear())
    served = asyncio.run(everyone())
    peak = on_engine(tiny_server, lambda e: max(r.batch_seqs for r in e.telemetry.records))
    assert peak > 1  # requests from different HTTP connections shared engine steps
    solo = kvlab.Engine(tiny_model, engine_config("paged", max_model_len=512))
    for (text, count), ids, n in zip(served, prompts, lengths):
        params = kvlab.SamplingParams(max_new_tokens=n, ignore_eos=True)
        alone = solo.generate([ids], params)[0]
        assert (text, count) == (alone.text, n)
    check_clean(tiny_server)


def test_bad_requests_get_4xx_naming_the_limit_while_others_run(tight_server, tiny_model):
    url, name = f"{tight_server.url}/v1/completions", tiny_model.name
    good = {"model": name, "prompt": [5, 6, 7], "max_tokens": 150, "ignore_eos": True}
    result = {}

    def run_good():  # streams while the bad requests arrive
        with httpx.stream("POST", url, json={**good, "stream": True}, timeout=60) as response:
            result["events"] = [line for line in response.iter_lines() if line]

    worker = threading.Thread(target=run_good)
    worker.start()
    bad = [
        (b"{not json", 400, "malformed JSON"),
        ({"model": "no-such-model", "prompt": "hi"}, 404, "`no-such-model` does not exist"),
        ({"model": name, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens=0"),
        ({"model": name, "prompt": "hi", "max_tokens": -2}, 400, "max_tokens=-2"),
        ({"model": name, "prompt": [1] * 600}, 400, "max_model_len=512"),
        ({"model": name, "prompt": [1, 2], "max_tokens": 400}, 400, "holds only 16 blocks"),
        ({"model": name, "prompt": [1, 49152]}, 400, "[0, 49152)"),
        ({"model": name, "prompt": ""}, 400, "prompt is empty"),
        ({"model": name, "prompt": ["a", "b"]}, 400, "one per request"),
        ({"model": name, "prompt": "hi", "temperature": -1}, 400, "temperature=-1"),
        ({"model": name, "prompt": "hi", "presence_penalty": 0.5}, 400, "not supported"),
        ({"model": name, "messages": []}, 400, "messages"),
    ]
    for body, status, message in bad:
        chat = isinstance(body, dict) and "messages" in body
        path = url.replace("completions", "chat/completions") if chat else url
        if isinstance(body, bytes):
            response = httpx.post(path, content=body, headers={"content-type": "application/json"})
        else:
            response = httpx.post(path, json=body)
        assert response.status_code == status, (body, response.text)
        assert message in response.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        client(tight_server).completions.create(model="nope", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="max_tokens=0"):
        client(tight_server).completions.create(model=name, prompt="hi", max_tokens=0)
    worker.join(60)
    chunks = [e for e in result["events"] if e != "data: [DONE]"]
    assert result["events"][-1] == "data: [DONE]" and '"finish_reason": "length"' in chunks[-1]
    check_clean(tight_server)


def test_disconnect_cancels_the_request_and_frees_its_blocks(tiny_server, tiny_model):
    url = f"{tiny_server.url}/v1/completions"
    body = {"model": tiny_model.name, "prompt": [9] * 40, "max_tokens": 450, "ignore_eos": True}
    aborted = scrape(tiny_server)["vllm:request_success_total{engine=0,finished_reason=abort}"]
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=30) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")  # a first token: the request holds blocks
    check_clean(tiny_server)  # the stream closed mid-answer: cancelled, blocks freed
    with pytest.raises(httpx.ReadTimeout):  # not streamed: the client gives up waiting
        httpx.post(url, json=body, timeout=0.2)
    check_clean(tiny_server)
    after = scrape(tiny_server)["vllm:request_success_total{engine=0,finished_reason=abort}"]
    assert after == aborted + 2


# --- /metrics --------------------------------------------------------------------------
def test_metrics_use_vllm_names_labels_and_meanings(tiny_model):
    from prometheus_client.parser import text_string_to_metric_families

    config = engine_config("paged+prefix", max_model_len=512, kv_budget_tokens=4096)
    with ServerThread(kvlab.Engine(tiny_model, config)) as server:
        body = {"model": tiny_model.name, "prompt": list(range(200, 240)), "max_tokens": 5}
        body["ignore_eos"] = True
        first = httpx.post(f"{server.url}/v1/completions", json=body).json()
        second = httpx.post(f"{server.url}/v1/completions", json=body).json()
        wait_idle(server)
        values = scrape(server)
        page = httpx.get(f"{server.url}/metrics").text
        num_blocks = on_engine(server, lambda e: e.cache.num_blocks)
        stats_free = on_engine(server, lambda e: int(e.stats()["blocks_free"].iloc[-1]))
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 32  # 2 full blocks
    expected = {
        "vllm:prefix_cache_queries_total": 80,
        "vllm:prefix_cache_hits_total": 32,
        "vllm:prompt_tokens_total": 80,
        "vllm:prompt_tokens_cached_total": 32,
        "vllm:generation_tokens_total": 10,
        "vllm:num_preemptions_total": 0,
        "vllm:num_requests_running": 0,
        "vllm:num_requests_waiting": 0,
        "vllm:kv_cache_usage_perc": 0.0,  # finished requests' blocks are cached, not used
        "vllm:time_to_first_token_seconds_count": 2,
        "vllm:e2e_request_latency_seconds_count": 2,
        "vllm:inter_token_latency_seconds_count": 8,
        "vllm:request_generation_tokens_sum": 10,
    }
    for name, value in expected.items():
        assert values[f"{name}{{engine=0}}"] == value, name
    assert values["vllm:request_success_total{engine=0,finished_reason=length}"] == 2
    # 40 prompt + 4 generated tokens in KV: 2 full blocks stay cached, the partial one is freed
    assert values["kvlab:kv_cache_cached_blocks{engine=0}"] == 2
    # free as vLLM counts it (its free queue holds cached blocks no request references), on
    # /metrics and in engine.stats() alike: every block, the 2 cached ones among them
    assert values["kvlab:kv_cache_free_blocks{engine=0}"] == num_blocks == stats_free

    ours = {f.name: f for f in text_string_to_metric_families(page)}
    theirs = {f.name: f for f in text_string_to_metric_families(VLLM_PAGE.read_text())}
    required = [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries",
        "vllm:prefix_cache_hits",
        "vllm:num_preemptions",
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds",
    ]
    assert set(required) <= set(ours)
    for name, family in ours.items():
        if not name.startswith("vllm:"):
            continue
        assert name in theirs and family.type == theirs[name].type, name
        labels = {k for s in family.samples for k in s.labels if not k.startswith("kvlab_")}
        assert labels <= {k for s in theirs[name].samples for k in s.labels}, name


# --- the command line --------------------------------------------------------------------
def test_kvlab_serve_command(tiny_model, tmp_path):
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    config = '{"cache": "paged", "prefix_caching": "hash", "max_num_seqs": 4}'
    argv = [sys.executable, "-m", "kvlab", "serve", "--model", tiny_model.name, "--port"]
    argv += [str(port), "--config", config, "--max-model-len", "256", "--budget", "2048tok"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, process, timeout_s=120)
        body = {"model": tiny_model.name, "prompt": [3, 4, 5], "max_tokens": 6, "ignore_eos": True}
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=30).json()
        assert reply["usage"]["completion_tokens"] == 6
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(30)
    text = log.read_text()
    assert "KV cache size: 2,048 tokens" in text
    assert "Maximum concurrency for 256 tokens per request: 8.00x" in text

    bad = subprocess.run(
        [sys.executable, "-m", "kvlab", "serve", "--config", "paged+nonsense"],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and "unknown option 'nonsense'" in bad.stderr
