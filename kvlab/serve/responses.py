"""The JSON shapes OpenAI's API (and vLLM's) answers with: whole responses, streamed chunks
(server-sent events), usage, errors and the model list."""

from __future__ import annotations

import json
import time
import uuid

from kvlab.serve.protocol import Job

OBJECTS = {  # (whole response, streamed chunk)
    "completion": ("text_completion", "text_completion"),
    "chat": ("chat.completion", "chat.completion.chunk"),
}


class ResponseIds:
    """The id, creation time and model every piece of one response repeats."""

    def __init__(self, job: Job):
        prefix = "cmpl" if job.kind == "completion" else "chatcmpl"
        self.kind, self.model = job.kind, job.model
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def head(self, streamed: bool) -> dict:
        whole, chunk = OBJECTS[self.kind]
        return {
            "id": self.id,
            "object": chunk if streamed else whole,
            "created": self.created,
            "model": self.model,
        }


ERROR_TYPES = {  # the openai SDK's names of its exceptions by status
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    413: "BadRequestError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def sse(data: dict | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def chunk(ids: ResponseIds, index: int, text: str, finish: str | None, role: bool) -> dict:
    """A streamed piece of one sample's text (chat: the first one also names the role)."""
    if ids.kind == "completion":
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
    else:
        delta = {"role": "assistant", "content": text} if role else {"content": text}
        if finish and not text and not role:
            delta = {}
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
    return {**ids.head(streamed=True), "choices": [choice]}


def usage_chunk(ids: ResponseIds, usage: dict, kvlab: dict) -> dict:
    """The last streamed chunk when stream_options.include_usage is set: no choices."""
    return {**ids.head(streamed=True), "choices": [], "usage": usage, "kvlab": kvlab}


def whole(ids: ResponseIds, texts: list[str], finishes: list, usage: dict, kvlab: dict) -> dict:
    """A non-streamed response with every sample."""
    choices = []
    for index, (text, finish) in enumerate(zip(texts, finishes)):
        choice = {"index": index, "logprobs": None, "finish_reason": finish}
        if ids.kind == "completion":
            choice["text"] = text
        else:
            choice["message"] = {"role": "assistant", "content": text}
        choices.append(choice)
    return {**ids.head(streamed=False), "choices": choices, "usage": usage, "kvlab": kvlab}


def error(message: str, status: int, param: str | None = None) -> dict:
    """vLLM's error body (the openai SDK raises BadRequestError, NotFoundError... on it)."""
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "BadRequestError"),
            "param": param,
            "code": status,
        }
    }


def model_list(model: str, max_model_len: int, created: int) -> dict:
    card = {
        "id": model,
        "object": "model",
        "created": created,
        "owned_by": "kvlab",
        "root": model,
        "parent": None,
        "max_model_len": max_model_len,
    }
    return {"object": "list", "data": [card]}
