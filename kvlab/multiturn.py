"""Multi-turn chat sessions: each turn's prompt is the conversation so far plus a new message.

`chat_sessions` builds conversations from kvlab's own text (kvlab.texts): a session opens
with a document and a question, and each later turn asks another question about it.
`run_sessions` serves them on an engine the way users come back: in rounds, every session
takes its next turn, so between two turns of one user come the turns of all the others (the
pause); at most `concurrency` turns run at once. A turn's prompt is the previous turn's
prompt, the tokens the model actually answered, and the new user message, as token ids, so
a cache that kept the conversation's blocks computes only the new part.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvlab import texts
from kvlab.config import SamplingParams
from kvlab.model.prompts import encode_messages

SYSTEM = "You are a careful assistant. Answer questions about the document the user shares."


@dataclass(frozen=True)
class ChatSession:
    """One user's conversation: a user message per turn (the first shares a document)."""

    session_id: str
    messages: tuple[str, ...]
    salt: str | None = None


@dataclass(frozen=True)
class Turn:
    """One served turn: its prompt, how much of it hit a cache, its answer and timing."""

    session_id: str
    turn: int
    request_id: int
    prompt_ids: tuple[int, ...]
    hit_tokens: int  # prompt tokens whose K/V came from a cache (device or a tier)
    output_ids: tuple[int, ...]
    ttft_s: float

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def computed_tokens(self) -> int:
        """Prompt tokens the model computed (prefill)."""
        return self.prompt_tokens - self.hit_tokens


def chat_sessions(
    n: int = 12, turns: int = 3, seed: int = 0, max_doc_chars: int = 2500
) -> list[ChatSession]:
    """`n` sessions of `turns` turns: a document (up to `max_doc_chars` characters, dealt in
    seeded shuffles) with a question, then a new question each turn."""
    if n < 1 or turns < 1:
        raise ValueError(f"n={n} and turns={turns} must both be >= 1")
    rng = random.Random(seed)
    docs = [d for d in texts.documents().values() if len(d) <= max_doc_chars]
    if not docs:
        raise ValueError(f"max_doc_chars={max_doc_chars}: no document is that short")
    questions, dealt = texts.questions(), []
    while len(dealt) < n:
        dealt += rng.sample(docs, len(docs))
    sessions = []
    for i, doc in enumerate(dealt[:n]):
        asked = rng.sample(questions, turns)
        opening = f"Here is a document.\n\n{doc}\n\nQuestion: {asked[0]}"
        sessions.append(ChatSession(f"user-{i:02d}", (opening, *asked[1:])))
    return sessions


def next_turn_ids(tokenizer, history: list[int], message: str) -> list[int]:
    """The conversation so far (token ids, ending with the assistant's answer) plus a new
    user message and the assistant's cue. ChatML markers where the tokenizer has them."""
    if "<|im_start|>" in tokenizer.get_vocab():
        text = f"\n<|im_start|>user\n{message}<|im_end|>\n<|im_start|>assistant\n"
    else:
        text = f"\nUser: {message}\nAssistant:"
    return history + list(tokenizer.encode(text, add_special_tokens=False))


def first_turn_ids(tokenizer, message: str) -> list[int]:
    """The opening prompt: the system message and the first user message, templated."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": message}]
        return encode_messages(tokenizer, messages)
    return list(tokenizer.encode(f"{SYSTEM}\nUser: {message}\nAssistant:"))


def run_sessions(
    engine, sessions: list[ChatSession], max_new_tokens: int = 16, concurrency: int = 2,
    end_after: bool = False, on_step=None,
) -> list[Turn]:  # fmt: skip
    """Serve every session's turns in rounds (see the module docstring); returns the turns
    in finish order. `end_after`: end each session (`engine.end_session`) after its last
    turn. `on_step(engine)` is called after every engine step (live figures)."""
    if concurrency < 1:
        raise ValueError(f"concurrency={concurrency} must be >= 1")
    tok = engine.tokenizer
    end_token = next(iter(sorted(engine.eos_ids)), None)
    order = [(t, s) for t in range(max(len(s.messages) for s in sessions)) for s in sessions
             if t < len(s.messages)]  # fmt: skip
    history: dict[str, list[int]] = {}
    busy: dict[int, tuple[ChatSession, int, list[int]]] = {}  # request id -> turn in flight
    done: list[Turn] = []
    params = SamplingParams(max_new_tokens=max_new_tokens)
    while order or busy:
        active = {s.session_id for s, _, _ in busy.values()}
        for item in list(order):
            if len(busy) >= concurrency:
                break
            t, session = item
            if session.session_id in active:
                continue
            order.remove(item)
            active.add(session.session_id)
            message = session.messages[t]
            ids = (first_turn_ids(tok, message) if t == 0
                   else next_turn_ids(tok, history[session.session_id], message))  # fmt: skip
            rid = engine.add_request(ids, params, salt=session.salt, session=session.session_id)
            busy[rid] = (session, t, ids)
        for out in engine.step():
            if out.request_id not in busy:
                continue
            session, t, ids = busy.pop(out.request_id)
            answer = list(out.token_ids)
            if end_token is not None and (not answer or answer[-1] not in engine.eos_ids):
                answer.append(end_token)
            history[session.session_id] = ids + answer
            m = out.metrics
            done.append(Turn(session.session_id, t, out.request_id, tuple(ids),
                             m.prefix_hit_tokens, tuple(out.token_ids), m.ttft_s))  # fmt: skip
            if end_after and t == len(session.messages) - 1:
                engine.end_session(session.session_id)
        if on_step is not None:
            on_step(engine)
    return done
