"""Traffic shapes made of kvlab's own text (kvlab.texts), deterministic by seed, and a JSONL format.

The shapes:

- doc-QA (`doc_qa`): every prompt is the same ~300-token assistant preamble, then one of the
  16 documents (~120 to ~1,600 tokens), then a question: prompts of ~430 to ~1,900 tokens.
  The shared preamble is the prefix that prefix caching can reuse; the document lengths make
  prompts of very different sizes; answers mix short (8-24 tokens) and long (64-128 tokens).
- chat (`chat`): short everyday prompts with no shared prefix and varied answer lengths.
- uniform chat (`uniform_chat`): the first n chat prompts, all with the same max_new_tokens, for
  fair throughput comparisons with HF `generate`.

Arrivals are all at 0 s (an offline batch) unless a rate is given: then they follow a Poisson
process (exponential gaps, mean 1/rate seconds). A workload file is JSONL, one request a line:
{"prompt": str | [token ids], "max_new_tokens": int, "arrival_s": float, "salt": str,
"priority": int}; the last three are optional and omitted when at their defaults.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from kvlab import texts


@dataclass(frozen=True)
class Request:
    """One request of a workload: a prompt, an output budget and when it arrives.

    `prompt` is text (the engine applies the chat template) or token ids (used as given).
    `salt` separates tenants for cache isolation; `priority` is for schedulers that use it.
    """

    prompt: str | list[int]
    max_new_tokens: int  # tokens
    arrival_s: float = 0.0  # seconds after the start of the run
    salt: str | None = None
    priority: int = 0
    session: str | None = None  # a conversation (kvlab.engine.sessions): end_session / TTL free it

    def __post_init__(self) -> None:
        if len(self.prompt) == 0:
            raise ValueError("Request.prompt is empty: give at least one character or token id")
        if self.max_new_tokens < 1:
            raise ValueError(f"Request.max_new_tokens={self.max_new_tokens} must be >= 1")
        if not self.arrival_s >= 0:  # also rejects NaN
            raise ValueError(f"Request.arrival_s={self.arrival_s} must be >= 0")


def _check_range(name: str, bounds: tuple[int, int]) -> None:
    lo, hi = bounds
    if not 1 <= lo <= hi:
        raise ValueError(f"{name}={bounds} must satisfy 1 <= low <= high")


def poisson_arrivals(requests: list[Request], rate: float, seed: int = 0) -> list[Request]:
    """Copies of `requests` arriving as a Poisson process of `rate` requests/s.

    The first arrives at 0 s; each gap after it is exponential with mean 1/rate seconds.
    """
    if rate <= 0:
        raise ValueError(f"rate={rate} must be > 0 (requests per second)")
    rng = random.Random(seed)
    out, t = [], 0.0
    for i, request in enumerate(requests):
        if i:
            t += rng.expovariate(rate)
        out.append(replace(request, arrival_s=t))
    return out


def doc_qa(
    n: int = 32,
    seed: int = 0,
    short_answer: tuple[int, int] = (8, 24),
    long_answer: tuple[int, int] = (64, 128),
    long_fraction: float = 0.3,
    rate: float | None = None,
) -> list[Request]:
    """Document QA: preamble + document + question; round(n * long_fraction) long answers.

    Documents are dealt in seeded shuffles of all 16, so any n >= 16 uses every length.
    max_new_tokens is uniform (inclusive) in `short_answer` or `long_answer`.
    """
    _check_range("short_answer", short_answer)
    _check_range("long_answer", long_answer)
    if not 0 <= long_fraction <= 1:
        raise ValueError(f"long_fraction={long_fraction} must lie in [0, 1]")
    rng = random.Random(seed)
    docs, questions = list(texts.documents().values()), texts.questions()
    bodies: list[str] = []
    while len(bodies) < n:
        bodies += rng.sample(docs, len(docs))
    n_long = round(n * long_fraction)
    is_long = [True] * n_long + [False] * (n - n_long)
    rng.shuffle(is_long)
    requests = [
        Request(
            f"{texts.preamble()}\n\n{body}\n\nQuestion: {rng.choice(questions)}",
            rng.randint(*(long_answer if long else short_answer)),
        )
        for body, long in zip(bodies, is_long)
    ]
    return requests if rate is None else poisson_arrivals(requests, rate, seed)


def chat(
    n: int = 16,
    seed: int = 0,
    max_new_tokens: tuple[int, int] = (16, 96),
    rate: float | None = None,
) -> list[Request]:
    """Plain chat: seeded sample of the 64 chat prompts (without replacement when n <= 64)."""
    _check_range("max_new_tokens", max_new_tokens)
    rng = random.Random(seed)
    pool = texts.chat_prompts()
    prompts = rng.sample(pool, n) if n <= len(pool) else rng.choices(pool, k=n)
    requests = [Request(p, rng.randint(*max_new_tokens)) for p in prompts]
    return requests if rate is None else poisson_arrivals(requests, rate, seed)


def uniform_chat(n: int = 16, max_new_tokens: int = 64) -> list[Request]:
    """The first n chat prompts (cycling past 64), all with the same max_new_tokens, at 0 s."""
    pool = texts.chat_prompts()
    return [Request(pool[i % len(pool)], max_new_tokens) for i in range(n)]


def with_salts(requests: list[Request], salts: list[str], seed: int | None = None) -> list[Request]:
    """Copies of `requests` with salts (tenants): round-robin, or a seeded shuffle of it.

    Either way each salt gets len(requests) / len(salts) requests, give or take one.
    """
    if not salts:
        raise ValueError("salts is empty: give at least one salt")
    labels = [salts[i % len(salts)] for i in range(len(requests))]
    if seed is not None:
        random.Random(seed).shuffle(labels)
    return [replace(r, salt=s) for r, s in zip(requests, labels)]


# Built-in workloads by name (as the CLI and notebooks spell them).
WORKLOADS: dict[str, Callable[..., list[Request]]] = {
    "doc-qa": doc_qa,
    "chat": chat,
    "uniform-chat": uniform_chat,
}


def load_workload(name_or_path: str | Path, **kwargs) -> list[Request]:
    """A built-in workload by name (kwargs passed on), or the requests of a .jsonl file."""
    if isinstance(name_or_path, str) and name_or_path in WORKLOADS:
        return WORKLOADS[name_or_path](**kwargs)
    path = Path(name_or_path)
    if path.suffix == ".jsonl" or path.is_file():
        if kwargs:
            raise TypeError(f"options {sorted(kwargs)} apply only to built-in workloads")
        return read_jsonl(path)
    raise ValueError(f"unknown workload {str(name_or_path)!r}: give one of {list(WORKLOADS)}")


_DEFAULTS = {"arrival_s": 0.0, "salt": None, "priority": 0}


def encode_requests(model, requests: list[Request]) -> list[Request]:
    """The same requests with token-id prompts (the engine's encoding of each), so every
    system under comparison sees identical tokens. `model`: a kvlab LoadedModel."""
    from kvlab.model.prompts import encode_prompt

    return [replace(r, prompt=encode_prompt(model.tokenizer, r.prompt)) for r in requests]


def write_jsonl(requests: list[Request], path: str | Path) -> None:
    """Write one JSON object per request; optional fields at their default are left out."""
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            row = {"prompt": r.prompt, "max_new_tokens": r.max_new_tokens}
            row.update({k: getattr(r, k) for k, v in _DEFAULTS.items() if getattr(r, k) != v})
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


_CHECKS: dict[str, tuple[Callable[[object], bool], str]] = {
    "prompt": (
        lambda x: isinstance(x, str) or (isinstance(x, list) and all(map(_is_int, x))),
        "a string or a list of integer token ids",
    ),
    "max_new_tokens": (_is_int, "an integer"),
    "arrival_s": (lambda x: _is_int(x) or isinstance(x, float), "a number"),
    "salt": (lambda x: x is None or isinstance(x, str), "a string or null"),
    "priority": (_is_int, "an integer"),
}


def read_jsonl(path: str | Path) -> list[Request]:
    """Read requests written by write_jsonl; ValueError names the line number and problem."""
    requests = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue  # blank lines are allowed
            where = f"{path}, line {number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: bad JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
            unknown = sorted(set(row) - set(_CHECKS))
            if unknown:
                raise ValueError(f"{where}: unknown field(s) {unknown}; known: {list(_CHECKS)}")
            for field in ("prompt", "max_new_tokens"):
                if field not in row:
                    raise ValueError(f"{where}: missing field {field!r}")
            for field, value in row.items():
                check, kind = _CHECKS[field]
                if not check(value):
                    raise ValueError(f"{where}: field {field!r} must be {kind}, got {value!r}")
            if "arrival_s" in row:
                row["arrival_s"] = float(row["arrival_s"])
            try:
                requests.append(Request(**row))
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
    return requests


def summary(requests: list[Request]) -> dict[str, float]:
    """Size of a workload: n, prompt words (token ids count one each) and output budget."""
    words = [
        len(r.prompt.split()) if isinstance(r.prompt, str) else len(r.prompt) for r in requests
    ]
    return {
        "n": len(requests),
        "prompt_words_min": min(words, default=0),
        "prompt_words_mean": sum(words) / len(words) if words else 0.0,
        "prompt_words_max": max(words, default=0),
        "total_max_new_tokens": sum(r.max_new_tokens for r in requests),
        "last_arrival_s": max((r.arrival_s for r in requests), default=0.0),  # seconds
    }
