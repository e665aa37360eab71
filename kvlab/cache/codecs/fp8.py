"""fp8 KV (e4m3, e5m2): fp8 codes with one bf16 scale per token per kv head."""

from __future__ import annotations

import torch

from kvlab.cache.codecs.base import SCALE_DTYPE, Field, KVSpec, TokenCodec
from kvlab.cache.codecs.quant import scale_for
from kvlab.cache.codecs.registry import CODECS


class Float8(TokenCodec):
    """fp8 codes (bits stored as uint8) with one bf16 scale per token per kv head.

    x / s, with s = amax / fp8_max, is cast to fp8 (round to nearest), so the head's
    largest value lands on fp8's largest. Per token per head, like int8, rather than per
    block: a token's scale is final when it is written (nothing to re-quantize later).
    """

    fp8: torch.dtype
    has_kernel = True

    @classmethod
    def fields(cls, spec: KVSpec, dtype: torch.dtype) -> list[Field]:
        heads, dim = spec.num_kv_heads, spec.head_dim
        return [((heads, dim), torch.uint8), ((heads,), SCALE_DTYPE)]

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        top = torch.finfo(self.fp8).max
        x = x.float()
        s = scale_for(x.abs().amax(-1), top)
        sf = s.float()[..., None]
        y = torch.where(sf > 0, x / sf, 0.0).clamp(-top, top).to(self.fp8)
        return y.view(torch.uint8), s

    def decode(self, fields: list[torch.Tensor]) -> torch.Tensor:
        q, s = fields
        return (q.view(self.fp8).float() * s.float()[..., None]).to(self.dtype)


@CODECS.register("fp8_e4m3")
class FP8E4M3(Float8):
    """fp8 e4m3 (3 mantissa bits, max 448). |err| <= 2^-4 |x| + 2^-10 s, s ~ amax/448."""

    fp8, describe = torch.float8_e4m3fn, "fp8 e4m3, scale per token per head"


@CODECS.register("fp8_e5m2")
class FP8E5M2(Float8):
    """fp8 e5m2 (2 mantissa bits, max 57344). |err| <= 2^-3 |x| + 2^-17 s, s ~ amax/57344."""

    fp8, describe = torch.float8_e5m2, "fp8 e5m2, scale per token per head"
