"""Prompts to token ids in the HTTP layer, before the engine thread sees a request.

A tokenizer can fail on what a client sends (a chat template that refuses a role, text
no tokenizer takes): that must fail the request, never the engine loop. The `Encoder`
runs in one worker thread of its own (off the event loop, whose other requests keep
streaming while a long prompt is tokenized) with its own copy of the tokenizer (the
engine thread decodes with the original at the same time).
"""

from __future__ import annotations

import asyncio
import copy
from concurrent.futures import ThreadPoolExecutor

from jinja2 import TemplateError

from kvlab.model.prompts import encode_messages, encode_prompt
from kvlab.serve.protocol import BadRequest, Job


class Encoder:
    def __init__(self, tokenizer):
        self.tokenizer = copy.deepcopy(tokenizer)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvlab-encode")

    def encode(self, job: Job) -> list[int]:
        """The job's prompt as token ids (chat: through the model's chat template); a
        BadRequest for a prompt the tokenizer or template refuses."""
        try:
            if job.kind == "chat":
                return encode_messages(self.tokenizer, job.prompt)
            return encode_prompt(self.tokenizer, job.prompt, chat=False)
        except (ValueError, TemplateError) as error:
            param = "messages" if job.kind == "chat" else "prompt"
            raise BadRequest(f"{param} cannot be tokenized: {error}", param=param) from None

    async def __call__(self, job: Job) -> list[int]:
        """`encode` in the encoder's thread."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.encode, job)

    def close(self) -> None:
        self._pool.shutdown(wait=False)
