"""Request parsing: an OpenAI completions / chat-completions body -> a `Job` for the engine.

Field names are OpenAI's (`prompt` / `messages`, `max_tokens`, `temperature`, `top_p`,
`seed`, `n`, `stream`, `stop`), plus vLLM's extensions that its benchmark client sends
(`ignore_eos`, `top_k`, `repetition_penalty` at its neutral 1.0). A field kvlab cannot
honour (a penalty, logprobs, a logit bias...) is refused with a 400 naming it, rather than
silently ignored; a field nobody here knows is ignored, as vLLM does.

Checks that need the engine (prompt length, the KV budget) happen in the engine loop:
its ValueErrors become 400s there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Literal

from kvlab.config import SamplingParams

# OpenAI's default for /v1/completions when max_tokens is absent (chat: the rest of the
# context, as vLLM does).
DEFAULT_COMPLETION_TOKENS = 16
# Fields kvlab cannot honour, with the values that mean "off" (accepted and ignored).
UNSUPPORTED: dict[str, tuple] = {
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "suffix": (None, ""),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "logit_bias": (None, {}),
    "min_tokens": (None, 0),
    "tools": (None, []),
}


class BadRequest(ValueError):
    """A request the server refuses: HTTP `status` with a message naming the limit."""

    def __init__(self, message: str, param: str | None = None, *, status: int = 400):
        super().__init__(message)
        self.status, self.param = status, param


@dataclass
class Job:
    """One parsed request, as the engine loop receives it."""

    kind: Literal["completion", "chat"]
    prompt: str | list[int] | list[dict]  # text, token ids, or chat messages
    params: SamplingParams
    max_tokens: int | None  # None: the rest of max_model_len (resolved by the loop)
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with usage
    stop: list[str] = field(default_factory=list)  # stop strings (not in the output)
    model: str = ""


def parse_body(raw: bytes) -> dict:
    """The JSON object of a request body (400 if it is not one)."""
    try:
        body = json.loads(raw or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise BadRequest(f"malformed JSON body: {error}") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def parse_completion(body: dict, model: str) -> Job:
    """A /v1/completions body: `prompt` is text, a list of token ids, or a list of one."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise BadRequest(
            f"prompt holds {len(prompt)} prompts: kvlab serve takes one per request (send "
            "several requests at once: the engine batches them)",
            param="prompt",
        )
    if isinstance(prompt, list):
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise BadRequest("prompt must be a string or a list of token ids", param="prompt")
    elif not isinstance(prompt, str):
        raise BadRequest("prompt must be a string or a list of token ids", param="prompt")
    if not prompt:
        raise BadRequest("prompt is empty: give at least one character or token id", "prompt")
    return _job("completion", prompt, body, model, DEFAULT_COMPLETION_TOKENS)


def parse_chat(body: dict, model: str) -> Job:
    """A /v1/chat/completions body: `messages` of {role, content} (text or text parts)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of {role, content}", "messages")
    clean = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a role", "messages")
        clean.append({"role": message["role"], "content": _text(message.get("content"), i)})
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    return _job("chat", clean, {**body, "max_tokens": limit}, model, None)


def _text(content, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        parts = [p.get("text") for p in content if isinstance(p, dict)]
        if all(isinstance(p, str) for p in parts) and len(parts) == len(content):
            return "".join(parts)
    raise BadRequest(f"messages[{index}].content must be text or a list of text parts")


def _job(kind, prompt, body: dict, model: str, default_tokens: int | None) -> Job:
    requested = body.get("model") or model
    if requested != model:
        raise BadRequest(f"The model `{requested}` does not exist.", status=404, param="model")
    for name, neutral in UNSUPPORTED.items():
        if body.get(name) not in neutral:
            raise BadRequest(f"{name}={body[name]!r} is not supported by kvlab serve", param=name)
    max_tokens = body.get("max_tokens", default_tokens)
    if max_tokens is not None and (not _is_int(max_tokens) or max_tokens <= 0):
        raise BadRequest(f"max_tokens={max_tokens!r} must be an integer >= 1", param="max_tokens")
    n = body.get("n", 1)
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        raise BadRequest(f"best_of={best_of!r} is not supported (only best_of == n)", "best_of")
    try:
        params = SamplingParams(
            max_new_tokens=max_tokens or 1,  # the loop fills in the rest of the context
            n=_number(body, "n", 1, int),
            temperature=_number(body, "temperature", 1.0, float),
            top_p=_number(body, "top_p", 1.0, float),
            top_k=max(0, _number(body, "top_k", 0, int)),  # vLLM: -1 means off
            seed=body.get("seed"),
            ignore_eos=bool(body.get("ignore_eos", False)),
        )
    except ValueError as error:
        raise BadRequest(str(error).replace("SamplingParams.", "")) from None
    if params.seed is not None and not _is_int(params.seed):
        raise BadRequest(f"seed={params.seed!r} must be an integer", param="seed")
    options = body.get("stream_options") or {}
    return Job(
        kind,
        prompt,
        params,
        max_tokens,
        stream=bool(body.get("stream", False)),
        include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
        stop=_stop(body.get("stop")),
        model=model,
    )


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(body: dict, name: str, default, kind):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(f"{name}={value!r} must be a number", param=name)
    if kind is int and value != int(value):
        raise BadRequest(f"{name}={value!r} must be an integer", param=name)
    return kind(value)


def _stop(stop) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise BadRequest("stop must be a non-empty string or a list of them", param="stop")
    return stops
