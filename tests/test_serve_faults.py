"""One request that fails, at any stage, fails alone: `kvlab serve` and its other requests
go on, token-identical to solo runs, and no block is left in use.

A fault is injected at each stage a request passes (encoding in the HTTP layer, the
engine's admission, its forward and its sampling, detokenizing on the loop thread, the
stream's chunks) for one "poisoned" request among good ones sent at the same time. The
poisoned request carries a sentinel token in its prompt and a sentinel stop string, so
each fault knows its victim. An engine that cannot go on (EngineDead out of step) makes
the server answer 503 to all, and /health says why. The tiny model serves.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

pytest.importorskip("fastapi")

import kvlab  # noqa: E402
import kvlab.engine.postprocess as engine_module  # noqa: E402
from kvlab.integrity import EngineDead  # noqa: E402
from kvlab.serve import ServerThread, engine_config  # noqa: E402
from kvlab.serve.detokenize import TextStream  # noqa: E402
from kvlab.serve.events import Delta  # noqa: E402
from kvlab.serve.streaming import EventStream  # noqa: E402

SENTINEL, MARK, TOKENS = 4242, "POISONED", 10
GOOD = [[100 + 7 * i + j for j in range(6 + 5 * i)] for i in range(4)]
POISON = [SENTINEL, 7, 8, 9]


class Injected(RuntimeError):
    """The fault a test injects."""


@pytest.fixture(scope="module")
def server(tiny_model):
    config = engine_config("paged+prefix", max_model_len=256, kv_budget_tokens=4096)
    with ServerThread(kvlab.Engine(tiny_model, config)) as server:
        solo = kvlab.Engine(tiny_model, engine_config("paged", max_model_len=256))
        params = kvlab.SamplingParams(max_new_tokens=TOKENS, ignore_eos=True)
        server.expected = [solo.generate([p], params)[0].text for p in GOOD]
        yield server


def on_engine(server, fn):
    return server.loop.call(fn).result(timeout=30)


def wait_idle(server, timeout_s: float = 20.0) -> None:
    """Until the engine has nothing unfinished and holds no block; then its integrity."""
    deadline = time.monotonic() + timeout_s
    while on_engine(server, lambda e: e.has_unfinished() or e.cache.allocator.num_used):
        assert time.monotonic() < deadline, "the engine did not go idle"
        time.sleep(0.05)
    on_engine(server, lambda e: e.cache.check_integrity())


async def ask(http, url: str, prompt, stream: bool, stop=None) -> tuple[int, str]:
    """(status, text) of one request; an error event in a stream gives its code and message."""
    body = {"prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
    body.update({"stop": stop} if stop else {}, stream=stream)
    if not stream:
        reply = await http.post(url, json=body)
        data = reply.json()
        ok = reply.status_code == 200
        return reply.status_code, data["choices"][0]["text"] if ok else data["error"]["message"]
    text = ""
    async with http.stream("POST", url, json=body) as reply:
        if reply.status_code != 200:
            return reply.status_code, json.loads(await reply.aread())["error"]["message"]
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                return event["error"]["code"], event["error"]["message"]
            text += event["choices"][0]["text"]
    return 200, text


def run_mix(server) -> tuple[list[tuple[int, str]], tuple[int, str]]:
    """The good prompts (streamed and not) and the poisoned one, all at once."""
    url = f"{server.url}/v1/completions"

    async def everyone():
        async with httpx.AsyncClient(timeout=60) as http:
            good = [ask(http, url, p, stream=i % 2 == 0) for i, p in enumerate(GOOD)]
            return await asyncio.gather(ask(http, url, POISON, True, [MARK]), *good)

    poisoned, *good = asyncio.run(everyone())
    return good, poisoned


def poisoned(seqs) -> bool:
    return any(SENTINEL in seq.prompt_ids for seq in seqs)


def inject(stage: str, server, monkeypatch) -> None:
    engine = server.server.engine
    if stage == "encode":
        encode = server.server.encoder.encode

        def failing_encode(job):
            if job.prompt == POISON:
                raise Injected("the tokenizer broke")
            return encode(job)

        monkeypatch.setattr(server.server.encoder, "encode", failing_encode)
    elif stage == "admission":
        make_sequence = engine.make_sequence

        def failing_admission(ids, *args, **kwargs):
            if SENTINEL in ids:
                raise Injected("admission broke")
            return make_sequence(ids, *args, **kwargs)

        monkeypatch.setattr(engine, "make_sequence", failing_admission)
    elif stage == "forward":
        forward = engine.runner.forward

        def failing_forward(input_ids, *args, **kwargs):
            if (input_ids == SENTINEL).any():
                raise Injected("the forward broke")
            return forward(input_ids, *args, **kwargs)

        monkeypatch.setattr(engine.runner, "forward", failing_forward)
    elif stage == "sampling":
        sample = engine_module.sample

        def failing_sample(logits, seqs):
            if poisoned(seqs):
                raise Injected("sampling broke")
            return sample(logits, seqs)

        monkeypatch.setattr(engine_module, "sample", failing_sample)
    elif stage == "detokenize":
        add = TextStream.add

        def failing_add(self, tokens):
            if MARK in self.stop:
                raise Injected("the detokenizer broke")
            return add(self, tokens)

        monkeypatch.setattr(TextStream, "add", failing_add)
    elif stage == "stream write":
        format_event = EventStream._format

        def failing_format(self, event, *args):
            if MARK in self.job.stop and isinstance(event, Delta):
                raise Injected("a chunk could not be written")
            return format_event(self, event, *args)

        monkeypatch.setattr(EventStream, "_format", failing_format)


STAGES = {  # stage -> words of the poisoned request's 500
    "encode": "encoding failed: Injected: the tokenizer broke",
    "admission": "admission failed: Injected: admission broke",
    "detokenize": "detokenizing failed: Injected: the detokenizer broke",
    "stream write": "streaming failed: Injected: a chunk could not be written",
}
ENGINE_STAGES = {"forward": "the forward broke", "sampling": "sampling broke"}


def check_alone(server, stage: str, words: str, monkeypatch) -> None:
    inject(stage, server, monkeypatch)
    good, (status, message) = run_mix(server)
    assert (status, words in message) == (500, True), message
    assert good == [(200, text) for text in server.expected]  # token-identical
    monkeypatch.undo()
    wait_idle(server)  # the poisoned request's blocks were freed too
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert run_mix(server)[0] == [(200, text) for text in server.expected]


@pytest.mark.parametrize("stage", list(STAGES))
def test_a_fault_at_any_stage_fails_that_request_alone(server, stage, monkeypatch):
    check_alone(server, stage, STAGES[stage], monkeypatch)


def test_a_request_the_engine_retires_with_an_error_fails_alone_mid_stream(server, monkeypatch):
    """The engine's contract: a request whose forward or sampling raised is retired alone,
    finish_reason "error"; here after it streamed tokens already."""
    engine = server.server.engine
    step = engine.step

    def step_retiring_the_poisoned():
        finished = step()
        for seq in list(engine.scheduler.running):
            if SENTINEL in seq.prompt_ids and len(seq.output_ids) >= 3:
                finished += engine._retire(seq, "error", engine.clock())
        return finished

    monkeypatch.setattr(engine, "step", step_retiring_the_poisoned)
    good, (status, message) = run_mix(server)
    assert status == 500 and "engine error" in message
    assert good == [(200, text) for text in server.expected]
    monkeypatch.undo()
    wait_idle(server)


@pytest.mark.parametrize("stage", list(ENGINE_STAGES))
def test_a_fault_in_the_engine_step_fails_that_request_alone(tiny_model, stage, monkeypatch):
    """The engine finds the request behind a failed forward or sampling and retires it
    alone; the loop answers it 500 (each stage on a server of its own)."""
    config = engine_config("paged+prefix", max_model_len=256, kv_budget_tokens=4096)
    with ServerThread(kvlab.Engine(tiny_model, config)) as server:
        solo = kvlab.Engine(tiny_model, engine_config("paged", max_model_len=256))
        params = kvlab.SamplingParams(max_new_tokens=TOKENS, ignore_eos=True)
        server.expected = [solo.generate([p], params)[0].text for p in GOOD]
        check_alone(server, stage, ENGINE_STAGES[stage], monkeypatch)


def test_an_engine_that_cannot_go_on_answers_503_and_health_says_why(tiny_model):
    config = engine_config("paged+prefix", max_model_len=256, kv_budget_tokens=4096)
    engine = kvlab.Engine(tiny_model, config)
    step = engine.step

    def dying_step():
        if poisoned(engine.scheduler.running):
            raise EngineDead("worker 1 exited with code -9")
        return step()

    engine.step = dying_step
    with ServerThread(engine) as server:
        good, (status, message) = run_mix(server)
        assert status == 503 and "worker 1 exited with code -9" in message
        assert all(s in (200, 503) for s, _ in good)  # done before it died, or told at once
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 503
        assert "EngineDead: worker 1 exited" in health.json()["error"]["message"]
        reply = httpx.post(f"{server.url}/v1/completions", json={"prompt": [1, 2]}, timeout=10)
        assert reply.status_code == 503 and "cannot go on" in reply.json()["error"]["message"]
