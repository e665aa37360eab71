"""Request bodies: OpenAI's completions and chat-completions as pydantic models -> a `Job`.

The models are the one description of what a body may hold: the app publishes them in
its OpenAPI schema (/openapi.json) and `parse` validates every body against them, so a
value out of range gets a 400 naming the field, its value and the limit. Ranges are
vLLM's (its `SamplingParams._verify_args` and its OpenAI protocol models): n >= 1,
temperature >= 0, 0 < top_p <= 1, top_k -1, 0 or >= 1, max_tokens >= 1, seed a 64-bit
integer, penalties in [-2, 2]. Types are strict (`true` is not 1, "5" is not 5) and
numbers finite. A field kvlab cannot honour (penalties, logprobs, a logit bias...) is
refused unless it holds its neutral value; a field nobody here knows is ignored, as vLLM
does. Checks that need the engine (prompt length, the KV budget) happen in the engine
loop: its ValueErrors become 400s there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kvlab.config import SamplingParams
from kvlab.serve.tenants import engine_salt

# OpenAI's default for /v1/completions when max_tokens is absent (chat: the rest of the
# context, as vLLM does).
DEFAULT_COMPLETION_TOKENS = 16
# Fields kvlab cannot honour, with the values that mean "off" (accepted and ignored).
UNSUPPORTED: dict[str, tuple] = {
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "suffix": (None, ""),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "repetition_penalty": (None, 1),
    "min_p": (None, 0),
    "logit_bias": (None, {}),
    "min_tokens": (None, 0),
    "tools": (None, []),
}
Penalty = Annotated[float | None, Field(None, ge=-2, le=2)]


class BadRequest(ValueError):
    """A request the server refuses: HTTP `status` with a message naming the limit."""

    def __init__(self, message: str, param: str | None = None, *, status: int = 400):
        super().__init__(message)
        self.status, self.param = status, param


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: bool = False  # a last chunk with the usage


class Sampling(BaseModel):
    """The fields both endpoints share (OpenAI's, and vLLM's extensions)."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1)
    best_of: int | None = Field(None, ge=1)  # only best_of == n
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, description="-1 or 0: off; else >= 1")
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[Annotated[str, Field(min_length=1)]] | None = Field(None, min_length=1)
    ignore_eos: bool = False
    cache_salt: str | None = Field(None, min_length=1, description="vLLM's: its own cache")
    user: str | None = None  # OpenAI's end-user id (ignored)
    presence_penalty: Penalty = None
    frequency_penalty: Penalty = None
    repetition_penalty: float | None = Field(None, gt=0)
    min_p: float | None = Field(None, ge=0, le=1)
    min_tokens: int | None = Field(None, ge=0)
    top_logprobs: int | None = Field(None, ge=0)
    logit_bias: dict[str, float] | None = None

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int) -> int:
        if value == -1:
            return 0  # vLLM's "off"
        return value


class CompletionRequest(Sampling):
    """A /v1/completions body: `prompt` is text, token ids, or a list of one of them."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0)
    echo: bool | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt(cls, value, handler):
        try:
            prompt = handler(value)
        except ValidationError:
            raise ValueError("prompt must be a string or a list of token ids") from None
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            raise ValueError(
                f"prompt holds {len(prompt)} prompts: kvlab serve takes one per request "
                "(send several requests at once: the engine batches them)"
            )
        if not prompt:
            raise ValueError("prompt is empty: give at least one character or token id")
        return prompt


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["text"] = "text"
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(Sampling):
    """A /v1/chat/completions body: `messages` of {role, content} (text or text parts)."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer max_tokens
    logprobs: bool | None = None
    tools: list | None = None


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
    tenant: str | None = None  # who sent it (an API key's tenant); None: no keys
    salt: str | None = None  # the engine's cache namespace (tenant + cache_salt)
    prompt_ids: list[int] = field(default_factory=list)  # filled by the encoder


BODIES = {"completion": CompletionRequest, "chat": ChatCompletionRequest}


def parse(body: dict, kind: str, model: str, tenant: str | None = None) -> Job:
    """A validated Job of a completions ("completion") or chat ("chat") body from
    `tenant`; BadRequest names the field, its value and the limit (404: unknown model)."""
    try:
        request = BODIES[kind].model_validate(body)
    except ValidationError as error:
        first = error.errors(include_url=False)[0]
        param = str(first["loc"][0]) if first["loc"] else None
        raise BadRequest(_describe(first), param=param) from None
    requested = request.model or model
    if requested != model:
        raise BadRequest(f"The model `{requested}` does not exist.", status=404, param="model")
    for name, neutral in UNSUPPORTED.items():
        value = getattr(request, name, None)
        if value not in neutral:
            raise BadRequest(f"{name}={value!r} is not supported by kvlab serve", param=name)
    if request.best_of is not None and request.best_of != request.n:
        message = f"best_of={request.best_of} is not supported (only best_of == n)"
        raise BadRequest(message, param="best_of")
    if kind == "chat":
        prompt = [{"role": m.role, "content": m.text()} for m in request.messages]
        max_tokens, default = request.max_completion_tokens or request.max_tokens, None
    else:
        prompt, max_tokens, default = request.prompt, request.max_tokens, DEFAULT_COMPLETION_TOKENS
    max_tokens = max_tokens or default
    params = SamplingParams(
        max_new_tokens=max_tokens or 1,  # the loop fills in the rest of the context
        n=request.n,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        seed=request.seed,
        ignore_eos=request.ignore_eos,
    )
    options = request.stream_options
    stop = request.stop
    return Job(
        kind,
        prompt,
        params,
        max_tokens,
        stream=request.stream,
        include_usage=bool(options and options.include_usage),
        stop=[stop] if isinstance(stop, str) else list(stop or []),
        model=model,
        tenant=tenant,
        salt=engine_salt(tenant, request.cache_salt),
    )


def _describe(error: dict) -> str:
    """One pydantic error as `field=value: what is wrong` (messages[0].content=...)."""
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error["loc"])
    path = path.lstrip(".") or "body"
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "missing":
        return f"{path} is required"
    shown = repr(error["input"])
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return f"{path}={shown}: {message}"
