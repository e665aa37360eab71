"""What a body may be before it is parsed: its size, its JSON, its nesting, its strings.

    read_body(request, limits)   the body's bytes; 413 past --max-request-bytes (the
                                 Content-Length is checked first, then the bytes as read)
    load_json(raw, limits)       the JSON object; 400 for malformed JSON, NaN/Infinity
                                 (not JSON), nesting past max_json_depth, or a string no
                                 encoder can take (a lone UTF-16 surrogate, "\\ud800",
                                 is valid JSON but no UTF-8), naming where it is

Every check runs in the HTTP handler, before the engine thread sees anything.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from starlette.requests import Request

from kvlab.serve.protocol import BadRequest


@dataclass(frozen=True)
class ServeLimits:
    """Per-request and per-tenant limits of `kvlab serve`."""

    max_request_bytes: int = 1 << 20  # a body's size (413 past it); 1 MiB
    max_json_depth: int = 32  # nested arrays / objects in a body (OpenAI's need ~5)
    tenant_max_running: int | None = None  # a tenant's requests in the engine at once
    tenant_max_queued: int | None = None  # a tenant's requests waiting for one of those
    retry_after_s: int = 1  # the Retry-After of a 429

    def __post_init__(self) -> None:
        for name in ("max_request_bytes", "max_json_depth", "retry_after_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"ServeLimits.{name}={getattr(self, name)} must be >= 1")
        for name in ("tenant_max_running", "tenant_max_queued"):
            value = getattr(self, name)
            if value is not None and value < (1 if name == "tenant_max_running" else 0):
                raise ValueError(f"ServeLimits.{name}={value} is out of range")


async def read_body(request: Request, limits: ServeLimits) -> bytes:
    """The request's body, refused (413) once it grows past limits.max_request_bytes."""
    limit = limits.max_request_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise _too_large(len(body), limit)
    return bytes(body)


def _too_large(size: int, limit: int) -> BadRequest:
    return BadRequest(
        f"the request body holds {size:,} bytes or more, past --max-request-bytes={limit:,}",
        status=413,
    )


def _not_json(constant: str):
    raise BadRequest(f"malformed JSON body: {constant} is not JSON")


def load_json(raw: bytes, limits: ServeLimits) -> dict:
    """The JSON object of a body, checked for depth and encodable strings (400 if not)."""
    try:
        body = json.loads(raw or b"null", parse_constant=_not_json)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise BadRequest(f"malformed JSON body: {error}") from None
    except RecursionError:
        raise BadRequest(_too_deep(limits.max_json_depth)) from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    _check_tree(body, limits.max_json_depth)
    return body


def _too_deep(limit: int) -> str:
    return f"the JSON body nests arrays and objects deeper than max_json_depth={limit}"


def _check_tree(body: dict, max_depth: int) -> None:
    """Walk the parsed body (iteratively): its depth, and every key and string in UTF-8."""
    stack: list[tuple[object, str, int]] = [(body, "", 1)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, dict | list):
            if depth > max_depth:
                raise BadRequest(_too_deep(max_depth), param=_param(path))
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                where = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}".lstrip(".")
                _encodable(str(key), where)
                stack.append((item, where, depth + 1))
        elif isinstance(value, str):
            _encodable(value, path)


def _encodable(text: str, path: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        bad = _shown(text[error.start : error.end])
        raise BadRequest(
            f"{_shown(path)} holds {bad!r} at character {error.start}: a lone UTF-16 "
            "surrogate, not text (no UTF-8 encoding)",
            param=_param(path),
        ) from None


def _shown(text: str) -> str:
    """Text with its lone surrogates escaped (\\ud800), fit for a UTF-8 response."""
    return text.encode("utf-8", "backslashreplace").decode()


def _param(path: str) -> str | None:
    """The top-level field of a path ("messages" of "messages[0].content")."""
    return _shown(path.split(".")[0].split("[")[0]) or None
