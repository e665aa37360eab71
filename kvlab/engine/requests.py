"""The engine's request API: a request is validated and queued, cancelled, ended with its
session, and explained.

Every check happens before anything is queued: a bad request raises ValueError naming the
limit, and the engine's queues stay as they were.
"""

from __future__ import annotations

import torch

from kvlab.config import SamplingParams
from kvlab.engine.sessions import SessionEnd
from kvlab.model.prompts import encode_prompt
from kvlab.sequence import Sequence

Prompt = str | list[int]


class RequestAPI:
    """EngineCore's requests (a mixin: it reads the core's parts and queues)."""

    def encode(self, prompt: Prompt, chat: bool | None = None) -> list[int]:
        """Token ids of a prompt; strings get the chat template when the model has one."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: give at least one character")
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as error:
                raise ValueError(
                    f"prompt is not valid text: {error.reason} at character {error.start} "
                    f"({prompt[error.start : error.end]!r})"
                ) from None
        ids = encode_prompt(self.tokenizer, prompt, chat)
        vocab = self.runner.embed.shape[0]
        if not ids:
            raise ValueError("prompt is empty: give at least one token id")
        if not isinstance(prompt, str) and (min(ids) < 0 or max(ids) >= vocab):
            raise ValueError(f"prompt token ids must lie in [0, {vocab}) (the vocabulary size)")
        return ids

    def make_sequence(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        chat: bool | None = None,
        arrival_s: float | None = None,
        salt: str | None = None,
        priority: int = 0,
        session: str | None = None,
    ) -> Sequence:
        """Validate a request and build its Sequence, without queueing it."""
        params = params or SamplingParams()
        if salt is not None and not isinstance(salt, str):
            raise ValueError(f"salt={salt!r} must be a string or None (a cache namespace)")
        if session is not None and not isinstance(session, str):
            raise ValueError(f"session={session!r} must be a string or None (a conversation)")
        ids = self.encode(prompt, chat)
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt of {len(ids)} tokens does not leave room for one new token within "
                f"max_model_len={self.max_model_len}"
            )
        if params.n > 1 and not self.cache.forks:
            raise ValueError(
                f"SamplingParams.n={params.n} > 1 needs EngineConfig(cache='paged'), a cache "
                f"whose sequences fork; cache={self.config.cache!r} does not"
            )
        if params.n > self.config.max_num_seqs:
            raise ValueError(
                f"SamplingParams.n={params.n} samples run at once, more than "
                f"EngineConfig.max_num_seqs={self.config.max_num_seqs}"
            )
        seq = self._new_sequence(ids, params, params.seed)
        seq.arrival_s = self.clock() if arrival_s is None else arrival_s
        seq.salt, seq.priority, seq.session = salt, priority, session
        self.cache.check_fits(seq)
        return seq

    def _new_sequence(self, ids: list[int], params: SamplingParams, seed: int | None) -> Sequence:
        generator = None
        if not params.greedy:
            generator = torch.Generator().manual_seed(seed if seed is not None else torch.seed())
        seq = Sequence(self._next_id, ids, params, generator=generator)
        self._next_id += 1
        return seq

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        chat: bool | None = None,
        arrival_s: float | None = None,
        salt: str | None = None,
        priority: int = 0,
        session: str | None = None,
    ) -> int:
        """Queue a request (raises ValueError for bad input, queuing nothing); returns its id.

        `salt` names a tenant / cache namespace: requests with different salts never share
        prefix-cached KV blocks. A higher `priority` is admitted first and preempted last.
        `session` names the conversation it belongs to (`end_session`, session_ttl_s).
        """
        seq = self.make_sequence(
            prompt, params, chat=chat, arrival_s=arrival_s, salt=salt, priority=priority,
            session=session,
        )  # fmt: skip
        return self.enqueue(seq)

    def enqueue(self, seq: Sequence) -> int:
        """Queue a sequence built by `make_sequence` (add_request is both in one call)."""
        self.scheduler.add(seq)
        self.sessions.on_add(seq, self.clock())
        return seq.request_id

    def samples(self, seq: Sequence) -> list[Sequence]:
        """Every sample of an unfinished request: `seq`, then (n > 1, once forked) its
        children, in sample order."""
        return self._groups.get(seq.request_id, [seq])

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def cancel(self, request_id: int) -> bool:
        """Stop a request (all its samples) now and free its blocks at once.

        Prefix-cached blocks go back to the LRU pool. Returns False if the request is not
        queued or running. Its output, with finish_reason "cancelled", lands in `finished`.
        """
        found = bool(self._members(request_id))
        self.finished.extend(self._retire_request(request_id, "cancelled", self.clock()))
        return found

    def end_session(self, session_id: str) -> SessionEnd:
        """End a conversation: cancel its unfinished requests and free its KV blocks on
        every tier (device cached blocks, host and disk copies), except blocks another
        live session also uses. Raises ValueError for an unknown session."""
        return self.sessions.end(session_id, self.cancel, self.cache)

    def explain(self, request_id: int) -> str:
        """What the engine did to a request and why, one line per event: how much of its
        prompt hit the prefix cache (and if not all, the reason it missed), and every
        preemption with its cause (who needed how many blocks, how many were free, the
        victim rule's choice). Raises ValueError for an unknown request id."""
        done = [out for out in self.finished if out.request_id == request_id]
        live = self._members(request_id)
        if not done and not live:
            raise ValueError(f"request_id={request_id} is neither queued, running nor finished")
        notes = done[0].notes if done else [n for s in live for n in s.notes]
        return "\n".join(n.text for n in notes) or (
            f"request {request_id}: nothing to explain (no prefix caching, never preempted)"
        )
