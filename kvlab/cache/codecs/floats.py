"""Float storage: the model's own dtype (the baseline), or a cast to fp16 / bf16."""

from __future__ import annotations

import torch

from kvlab.cache.codecs.base import Field, KVSpec, TokenCodec
from kvlab.cache.codecs.registry import CODECS


@CODECS.register(None)
class ModelDtype(TokenCodec):
    """The baseline: K/V stored in the model's own dtype, exactly (no check, no scale)."""

    describe, has_kernel = "the model's dtype (baseline)", True

    @classmethod
    def fields(cls, spec: KVSpec, dtype: torch.dtype) -> list[Field]:
        return [((spec.num_kv_heads, spec.head_dim), dtype)]

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (x.to(self.dtype),)

    def decode(self, fields: list[torch.Tensor]) -> torch.Tensor:
        return fields[0]


class FloatCast(TokenCodec):
    """K/V cast to a narrower float, no scale; ValueError for values it cannot hold."""

    storage: torch.dtype

    @classmethod
    def fields(cls, spec: KVSpec, dtype: torch.dtype) -> list[Field]:
        return [((spec.num_kv_heads, spec.head_dim), cls.storage)]

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = x.to(self.storage)
        if y.numel() and not bool(y.abs().amax().isfinite()):
            limit = torch.finfo(self.storage).max
            raise ValueError(f"kv_codec={self.name!r} cannot hold |x| > {limit:g}: it overflows")
        return (y,)

    def decode(self, fields: list[torch.Tensor]) -> torch.Tensor:
        return fields[0].to(self.dtype)


@CODECS.register("fp16")
class FP16(FloatCast):
    """IEEE half. |err| <= 2^-11 |x| (normal range), <= 2^-25 below 2^-14; |x| <= 65504."""

    storage, describe, has_kernel = torch.float16, "fp16 cast", True


@CODECS.register("bf16")
class BF16(FloatCast):
    """bfloat16: fp32's range, 8 significant bits. |err| <= 2^-8 |x| (normal range)."""

    storage, describe, has_kernel = torch.bfloat16, "bf16 cast", True
