"""`kvlab serve`'s limits, as vLLM and OpenAI check them, and no body of any shape stops it.

Each limit is a 4xx in OpenAI's error shape naming the field (or the flag), answered
before anything is queued; then property-based tests: schemathesis generates bodies from
the OpenAPI schema the server itself publishes (bodies that fit it, and bodies that break
it), hypothesis generates arbitrary JSON: never a 5xx, and after every one the server
still answers a good request with the text of a solo run. The tiny model serves.
"""

from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("fastapi")
schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

import kvlab  # noqa: E402
from kvlab.serve import ServerThread, engine_config  # noqa: E402
from kvlab.serve.limits import ServeLimits  # noqa: E402

LIMITS = ServeLimits(max_request_bytes=4096, max_json_depth=8)
GOOD = {"prompt": [11, 12, 13], "max_tokens": 3, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_model):
    config = engine_config("paged+prefix", max_model_len=64, kv_budget_tokens=1024)
    with ServerThread(kvlab.Engine(tiny_model, config), limits=LIMITS) as server:
        solo = kvlab.Engine(tiny_model, engine_config("paged", max_model_len=64))
        params = kvlab.SamplingParams(max_new_tokens=3, ignore_eos=True)
        server.expected = solo.generate([GOOD["prompt"]], params)[0].text
        yield server


def post(server, body, path="/v1/completions", **options) -> httpx.Response:
    if isinstance(body, bytes):
        options["content"], options["headers"] = body, {"content-type": "application/json"}
    else:
        options["json"] = body
    return httpx.post(f"{server.url}{path}", timeout=60, **options)


def assert_still_serving(server) -> None:
    reply = post(server, GOOD)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == server.expected


REFUSED = [  # (body, status, param, words the message holds)
    ({"prompt": "hi", "top_k": -7}, 400, "top_k", "top_k=-7"),
    ({"prompt": "hi", "top_k": 2.5}, 400, "top_k", "top_k=2.5"),
    ({"prompt": "hi", "temperature": -0.5}, 400, "temperature", "greater than or equal to 0"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p", "top_p=0"),
    ({"prompt": "hi", "top_p": 1.5}, 400, "top_p", "less than or equal to 1"),
    ({"prompt": "hi", "n": 0}, 400, "n", "n=0"),
    ({"prompt": "hi", "n": True}, 400, "n", "valid integer"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "max_tokens=0"),
    ({"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens", "valid integer"),
    ({"prompt": "hi", "seed": 2**64}, 400, "seed", "less than or equal to"),
    ({"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty", "less than or equal to 2"),
    ({"prompt": "hi", "presence_penalty": 1}, 400, "presence_penalty", "not supported"),
    ({"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty", "greater than 0"),
    ({"prompt": "hi", "min_p": 2}, 400, "min_p", "min_p=2"),
    ({"prompt": "hi", "best_of": 3}, 400, "best_of", "best_of == n"),
    ({"prompt": "hi", "stop": ""}, 400, "stop", "stop="),
    ({"prompt": "hi", "stream": "yes"}, 400, "stream", "stream='yes'"),
    ({"prompt": "hi", "cache_salt": ""}, 400, "cache_salt", "cache_salt"),
    ({"prompt": 5}, 400, "prompt", "prompt must be a string"),
    ({"prompt": []}, 400, "prompt", "prompt is empty"),
    ({}, 400, "prompt", "prompt is required"),
    ({"prompt": "\ud800"}, 400, "prompt", "lone UTF-16 surrogate"),
    ({"prompt": "hi", "extra": {"\udfff": 1}}, 400, "extra", "lone UTF-16 surrogate"),
    ({"prompt": "hi", "x": [[[[[[[[[1]]]]]]]]]}, 400, "x", "max_json_depth=8"),
    ({"prompt": "hi", "model": "other"}, 404, "model", "does not exist"),
    ({"prompt": "hi", "temperature": 1e400}, 400, None, "Infinity is not JSON"),
]


@pytest.mark.parametrize("body, status, param, words", REFUSED, ids=lambda v: str(v)[:40])
def test_each_limit_is_a_4xx_naming_the_field(server, body, status, param, words):
    raw = json.dumps(body).encode()  # json.dumps writes "\ud800" as a lone escape
    reply = post(server, raw)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert words in error["message"] and error["param"] == param, error
    assert error["code"] == status


def test_lone_surrogate_in_a_chat_message_and_nesting_past_the_parser(server):
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}
    reply = post(server, json.dumps(chat).encode(), "/v1/chat/completions")
    assert reply.status_code == 400
    assert "messages[0].content[0].text holds '\\\\ud800'" in reply.json()["error"]["message"]
    deep = b'{"prompt": "hi", "x": ' + b"[" * 2000 + b"]" * 2000 + b"}"
    reply = post(server, deep)  # under the size limit, past the parser's own depth
    assert reply.status_code == 400 and "max_json_depth=8" in reply.json()["error"]["message"]
    assert_still_serving(server)


def test_body_size_limit_is_a_413_declared_or_streamed(server):
    big = json.dumps({"prompt": "x" * 5000}).encode()
    reply = post(server, big)
    assert reply.status_code == 413
    assert "--max-request-bytes=4,096" in reply.json()["error"]["message"]

    def chunks():  # no Content-Length: the server counts as it reads
        for _ in range(10):
            yield b" " * 1000

    reply = httpx.post(f"{server.url}/v1/completions", content=chunks(), timeout=60)
    assert reply.status_code == 413
    assert_still_serving(server)


def test_the_openapi_schema_describes_the_bodies(server):
    schema = httpx.get(f"{server.url}/openapi.json").json()
    body = schema["paths"]["/v1/completions"]["post"]["requestBody"]["content"]
    assert body["application/json"]["schema"] == {"$ref": "#/components/schemas/CompletionRequest"}
    fields = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert fields["top_p"]["exclusiveMinimum"] == 0 and fields["top_k"]["minimum"] == -1
    assert "Message" in schema["components"]["schemas"]


# --- property-based: schemathesis over the served schema, hypothesis over any JSON --------
def test_no_generated_body_gets_a_5xx_and_good_requests_still_answer(server):
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    cases = st.one_of(
        schema[path]["POST"].as_strategy(generation_mode=mode)
        for path in ("/v1/completions", "/v1/chat/completions")
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    )
    statuses = []

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    @given(case=cases)
    def check(case):
        response = case.call(base_url=server.url, timeout=60)
        statuses.append(response.status_code)
        assert response.status_code < 500, (case.body, response.text)
        assert_still_serving(server)

    check()
    assert any(s == 200 for s in statuses) and any(400 <= s < 500 for s in statuses), statuses


SCALARS = st.none() | st.booleans() | st.integers() | st.text()
JSON = st.recursive(
    SCALARS | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)
FIELDS = st.sampled_from(["prompt", "messages", "max_tokens", "n", "top_k", "stop", "seed"])


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=st.dictionaries(FIELDS | st.text(max_size=5), JSON, max_size=5), chat=st.booleans())
def test_arbitrary_json_bodies_get_no_5xx(server, body, chat):
    reply = post(server, body, "/v1/chat/completions" if chat else "/v1/completions")
    assert reply.status_code < 500, (body, reply.text)
    if reply.status_code != 200:
        assert reply.json()["error"]["message"]
    assert httpx.get(f"{server.url}/health").status_code == 200
