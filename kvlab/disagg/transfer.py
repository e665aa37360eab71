"""KVTransfer: one prefilled request on its way from the prefill engine to the decode one."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from kvlab.cache.codecs import StoredKV
from kvlab.config import SamplingParams


def checksum(stored: StoredKV) -> str:
    """sha256 over every stored tensor's name, shape and bytes."""
    digest = hashlib.sha256()
    for name in sorted(stored.tensors):
        tensor = stored.tensors[name].contiguous()
        digest.update(f"{name}{tuple(tensor.shape)}".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@dataclass
class KVTransfer:
    """A request whose prompt is prefilled: its tokens, first output token and stored KV."""

    index: int  # the request's place in the caller's list
    prompt_ids: list[int]
    params: SamplingParams
    first_token: int
    kv_codec: str | None
    stored: StoredKV  # positions [0, len(prompt_ids)) in every layer, as the codec stores them
    digest: str  # checksum(stored) as the prefill side computed it
    prefill_s: float  # the prefill engine's step wall time so far, this one's step included
    prefill_steps: int = 0  # the prefill engine's steps so far (each counted once)

    @property
    def nbytes(self) -> int:
        return self.stored.nbytes

    def intact(self, bytes_per_token: int | None) -> bool:
        """Whether the KV arrived whole: the checksum matches and (token codecs) the bytes
        are exactly the prompt's KV bytes."""
        if checksum(self.stored) != self.digest:
            return False
        return bytes_per_token is None or self.nbytes == len(self.prompt_ids) * bytes_per_token
