"""int8 KV: one bf16 scale per token per kv head."""

from __future__ import annotations

import torch

from kvlab.cache.codecs.base import SCALE_DTYPE, Field, KVSpec, TokenCodec
from kvlab.cache.codecs.quant import quantize_symmetric
from kvlab.cache.codecs.registry import CODECS


@CODECS.register("int8")
class Int8(TokenCodec):
    """int8, symmetric, one bf16 scale per token per kv head: s = amax / 127.

    |err| <= s / 2 per element (s the stored scale, ~amax/127).
    """

    describe, has_kernel = "int8, scale per token per head", True

    @classmethod
    def fields(cls, spec: KVSpec, dtype: torch.dtype) -> list[Field]:
        heads, dim = spec.num_kv_heads, spec.head_dim
        return [((heads, dim), torch.int8), ((heads,), SCALE_DTYPE)]

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, s = quantize_symmetric(x, 127)
        return q.to(torch.int8), s

    def decode(self, fields: list[torch.Tensor]) -> torch.Tensor:
        q, s = fields
        return (q.float() * s.float()[..., None]).to(self.dtype)
