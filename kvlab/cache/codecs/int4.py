"""int4 KV: symmetric codes, one bf16 scale per group of 32 channels per token."""

from __future__ import annotations

import torch

from kvlab.cache.codecs.base import SCALE_DTYPE, Field, KVSpec, TokenCodec
from kvlab.cache.codecs.quant import group_size, pack, quantize_symmetric, unpack
from kvlab.cache.codecs.registry import CODECS


@CODECS.register("int4")
class Int4(TokenCodec):
    """int4, symmetric, one bf16 scale per group of 32 channels per token per kv head.

    Codes in [-7, 7] (stored +8, two per uint8). |err| <= s / 2, s ~ group amax / 7.
    Needs an even head_dim; a head_dim that 32 does not divide makes one group per head.
    """

    describe = "int4, scale per 32 channels per token"

    @classmethod
    def fields(cls, spec: KVSpec, dtype: torch.dtype) -> list[Field]:
        heads, dim = spec.num_kv_heads, spec.head_dim
        if dim % 2:
            raise ValueError(f"kv_codec='int4' packs two codes per byte: head_dim={dim} is odd")
        groups = dim // group_size(dim)
        return [((heads, dim // 2), torch.uint8), ((heads, groups), SCALE_DTYPE)]

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, s = quantize_symmetric(x.unflatten(-1, (-1, group_size(x.shape[-1]))), 7)
        return pack(q.flatten(-2) + 8, 4), s  # (T, H, D/2), (T, H, groups)

    def decode(self, fields: list[torch.Tensor]) -> torch.Tensor:
        p, s = fields
        q = unpack(p, 4).float() - 8  # (N, H, D)
        q = q.unflatten(-1, (s.shape[-1], -1)) * s.float()[..., None]
        return q.flatten(-2).to(self.dtype)
