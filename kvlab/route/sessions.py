"""Multi-turn chats over HTTP through any OpenAI-compatible endpoint (a router, a replica),
timed per turn: the workload of a fleet of replicas.

Sessions are kvlab.multiturn's (a document and a question, then more questions); each
turn sends the whole conversation as chat messages (the system prompt, every user message
so far, every answer as the server wrote it), as a chat client does, with the session's
tenant as vLLM's `cache_salt` (or, given the tokenizer, the same conversation as token
ids through the chat template). Turns go in rounds (every session takes its next turn, so
between two turns of one user come everyone else's), at most `concurrency` at once, each
streamed (greedy, `max_tokens`): time to the first token, the server's cached-token
count, and the replica that served it (the router's `x-kvlab-replica` header) per turn.

    turns = run_chats("http://127.0.0.1:8080", "SmolLM2-135M-Instruct", sessions)
    summary(turns, wall_s)   # hit rate, TTFT p50/p99, tok/s, imbalance
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass

import httpx

from kvlab.model.prompts import encode_messages
from kvlab.multiturn import SYSTEM, ChatSession, chat_sessions


@dataclass
class ChatTurn:
    session_id: str
    salt: str | None
    turn: int
    replica: str | None  # x-kvlab-replica, when a kvlab router served it
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    ttft_s: float
    e2e_s: float
    start_s: float  # since the run began
    text: str


def tenant_sessions(n: int, turns: int, tenants: int, seed: int = 0, max_doc_chars=2500):
    """`n` chat sessions over `tenants` tenants (session i belongs to tenant i % tenants,
    its cache_salt "tenant-k"): kvlab.multiturn.chat_sessions with salts."""
    sessions = chat_sessions(n, turns, seed, max_doc_chars)
    return [
        ChatSession(s.session_id, s.messages, f"tenant-{i % tenants}") if tenants else s
        for i, s in enumerate(sessions)
    ]


async def _turn(http, url, model, session, t, answers, max_tokens, t0, tokenizer) -> ChatTurn:
    messages = [{"role": "system", "content": SYSTEM}]
    for k in range(t + 1):
        messages.append({"role": "user", "content": session.messages[k]})
        if k < t:
            messages.append({"role": "assistant", "content": answers[k]})
    body = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": session.session_id,  # OpenAI's end-user field: the router logs it
    }
    if tokenizer is None:
        path, body["messages"] = "/v1/chat/completions", messages
    else:  # the chat template applied here: a completion of its token ids
        path, body["prompt"] = "/v1/completions", encode_messages(tokenizer, messages)
    if session.salt:
        body["cache_salt"] = session.salt
    start = time.perf_counter()
    first, text, usage, replica = None, "", None, None
    async with http.stream("POST", f"{url}{path}", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {(await response.aread())[:500]!r}")
        replica = response.headers.get("x-kvlab-replica")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            usage = event.get("usage") or usage
            for choice in event.get("choices", []):
                piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                if piece and first is None:
                    first = time.perf_counter()
                text += piece
    end = time.perf_counter()
    usage = usage or {}
    details = usage.get("prompt_tokens_details") or {}
    return ChatTurn(
        session.session_id, session.salt, t, replica, usage.get("prompt_tokens", 0),
        details.get("cached_tokens") or 0, usage.get("completion_tokens", 0),
        (first or end) - start, end - start, start - t0, text,
    )  # fmt: skip


async def chats(
    url: str, model: str, sessions: list[ChatSession], max_tokens: int = 32,
    concurrency: int = 4, timeout_s: float = 1800.0, on_turn=None, tokenizer=None,
) -> list[ChatTurn]:  # fmt: skip
    """Every session's turns in rounds (see the module docstring); turns in finish order.
    `on_turn(turn)` is called as each finishes (live figures). With a `tokenizer` the
    client applies the chat template itself and sends each turn's token ids to
    /v1/completions (as `kvlab replay` does): the same tokens, and a router that reads
    only token-id prompts (vllm-router's kv_aware over HTTP) can hash them."""
    if concurrency < 1:
        raise ValueError(f"concurrency={concurrency} must be >= 1")
    url = url.rstrip("/")
    order = [(t, s) for t in range(max(len(s.messages) for s in sessions)) for s in sessions
             if t < len(s.messages)]  # fmt: skip
    answers: dict[str, list[str]] = {s.session_id: [] for s in sessions}
    busy: dict[asyncio.Task, ChatSession] = {}
    done: list[ChatTurn] = []
    t0 = time.perf_counter()
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as http:
        while order or busy:
            active = {s.session_id for s in busy.values()}
            for item in list(order):
                if len(busy) >= concurrency:
                    break
                t, session = item
                if session.session_id in active or len(answers[session.session_id]) < t:
                    continue
                order.remove(item)
                active.add(session.session_id)
                coroutine = _turn(http, url, model, session, t, answers[session.session_id],
                                  max_tokens, t0, tokenizer)  # fmt: skip
                busy[asyncio.ensure_future(coroutine)] = session
            finished, _ = await asyncio.wait(busy, return_when=asyncio.FIRST_COMPLETED)
            for task in finished:
                session = busy.pop(task)
                turn = task.result()
                answers[session.session_id].append(turn.text)
                done.append(turn)
                if on_turn is not None:
                    on_turn(turn)
    return done


def run_chats(url: str, model: str, sessions: list[ChatSession], **options) -> list[ChatTurn]:
    """`chats` for callers with or without an event loop of their own (a notebook)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, chats(url, model, sessions, **options)).result()


def percentile(values: list[float], q: float) -> float | None:
    """The q-quantile by rank (the nearest-rank method replay uses)."""
    if not values:
        return None
    ranked = sorted(values)
    return ranked[min(len(ranked) - 1, int(q * len(ranked)))]


def summary(turns: list[ChatTurn], wall_s: float, replicas: list[str] | None = None) -> dict:
    """One row: prefix hit rate (cached / prompt tokens), TTFT p50/p99 over turns,
    throughput, and the imbalance between replicas (most requests on one replica over the
    mean, and the same for prompt tokens computed; 1.0 is perfectly even)."""
    prompt = sum(t.prompt_tokens for t in turns)
    cached = sum(t.cached_tokens for t in turns)
    ttft = [t.ttft_s for t in turns]
    names = replicas or sorted({t.replica for t in turns if t.replica})
    per = Counter(t.replica for t in turns)
    computed = Counter()
    for t in turns:
        computed[t.replica] += t.prompt_tokens - t.cached_tokens

    def imbalance(counts: Counter) -> float | None:
        values = [counts.get(n, 0) for n in names]
        return round(max(values) / statistics.mean(values), 3) if values and any(values) else None

    later = [t for t in turns if t.turn > 0]
    return {
        "turns": len(turns),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": round(cached / prompt, 4) if prompt else None,
        "later_turn_hit_rate": round(
            sum(t.cached_tokens for t in later) / max(1, sum(t.prompt_tokens for t in later)), 4
        ),
        "ttft_p50_s": round(percentile(ttft, 0.5), 4) if ttft else None,
        "ttft_p99_s": round(percentile(ttft, 0.99), 4) if ttft else None,
        "output_tokens": sum(t.output_tokens for t in turns),
        "wall_s": round(wall_s, 3),
        "tok_s": round(sum(t.output_tokens for t in turns) / wall_s, 3) if wall_s else None,
        "requests_per_replica": {n: per.get(n, 0) for n in names},
        "imbalance_requests": imbalance(per),
        "imbalance_computed_tokens": imbalance(computed),
    }


def turns_table(turns: list[ChatTurn]) -> list[dict]:
    return [{k: v for k, v in asdict(t).items() if k != "text"} for t in turns]
