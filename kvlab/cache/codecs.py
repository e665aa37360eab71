"""KV codecs: how the pool stores each token's K and V, from the model's dtype down to 2 bits.

A codec owns the pool's storage. It encodes K/V on `write` (quantize), decodes on `gather`
(dequantize, in plain torch) and reports `token_bytes`: the bytes one token costs in every
layer, K and V, **scales included**, so a byte budget buys more slots with a smaller codec.

Scaled codecs keep their scales in bfloat16 beside the codes: 2 bytes, the full fp32 range
(no overflow for huge values, unlike fp16 scales). Where a codec's error bound says `s`, it
means that stored scale.

NaN/inf: every codec except the baseline raises ValueError on a non-finite input (a NaN in
a scaled codec would silently spoil the scale of a whole head), and fp16/bf16 raise on
finite values they cannot hold (|x| > 65504 in fp16). The baseline stores anything, as
before codecs existed. Zeros round-trip exactly: an all-zero head or group gets scale 0,
and the symmetric codes (int8, fp8, int4) also keep every single zero exact; kivi2's
asymmetric codes keep only all-zero groups exact.

Names (EngineConfig.kv_dtype): None (the model's dtype), "fp16", "bf16", "int8",
"fp8_e4m3", "fp8_e5m2", "int4", and "kivi2" (kvlab/cache/kivi.py).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvlab.cache.pool import KVSpec

SCALE_DTYPE = torch.bfloat16
Field = tuple[tuple[int, ...], torch.dtype]  # per-slot shape and dtype of one stored tensor


@dataclass
class StoredKV:
    """What a codec stores for some slots, as it stores it (codes and scales, not values).

    Copy-on-write, swapping and tiers move these tensors as they are: bit-exact, with no
    decode and re-encode. Each tensor is (layers, n, ...) for n slots or key groups.
    """

    tensors: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def to(self, device: torch.device | str) -> StoredKV:
        return StoredKV({k: t.to(device, copy=True) for k, t in self.tensors.items()})


class KVCodec(ABC):
    """Stores K and V of `num_slots` token slots in every layer, encoded."""

    name: str | None = None
    describe: str = ""
    alignment: int = 1  # slots are used in aligned runs of this many consecutive positions
    window_tokens: int = 0  # most tokens per sequence held outside token_bytes (kivi2's window)

    def __init__(self, spec: KVSpec, num_slots: int, dtype: torch.dtype, device: torch.device):
        self.spec, self.num_slots, self.dtype, self.device = spec, num_slots, dtype, device

    @classmethod
    @abstractmethod
    def token_bytes(cls, spec: KVSpec, dtype: torch.dtype) -> int:
        """Bytes of one token's K and V in all layers, codes and scales (rounded up)."""

    @abstractmethod
    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Encode and store. slots: (T,) int64; k, v: (T, kv_heads, head_dim)."""

    @abstractmethod
    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoded K/V of slots (N,) -> k, v: (N, kv_heads, head_dim) in the model's dtype."""

    @abstractmethod
    def poison(self, slots: torch.Tensor) -> None:
        """Make every later read of these slots NaN (debug mode)."""

    @property
    @abstractmethod
    def stored(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The main stored K and V tensors, (layers, slots, ...): values or codes."""

    @abstractmethod
    def export(self, slots: torch.Tensor) -> StoredKV:
        """The stored codes of `slots` (N,) in every layer, on this codec's device."""

    @abstractmethod
    def load(self, slots: torch.Tensor, stored: StoredKV) -> None:
        """Store what `export` returned into (other) slots, bit for bit."""

    def copy(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """The codes of `source` slots into `target` slots, in every layer (bit-exact)."""
        self.load(target, self.export(source))

    def check_finite(self, layer: int, **tensors: torch.Tensor) -> None:
        for what, x in tensors.items():
            if x.numel() and not bool(x.abs().amax().isfinite()):  # amax keeps NaN and inf
                raise ValueError(
                    f"kv_dtype={self.name!r}: the {what} written to layer {layer} contain NaN "
                    f"or inf; this codec stores finite values only"
                )


class TokenCodec(KVCodec):
    """A codec that encodes each token on its own: a few stored tensors per slot."""

    @classmethod
    @abstractmethod
    def fields(cls, spec: KVSpec, dtype: torch.dtype) -> list[Field]:
        """Per-slot shape and dtype of each stored tensor (for K, and the same for V)."""

    @abstractmethod
    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(T, kv_heads, head_dim) -> one (T, *shape) tensor per field."""

    @abstractmethod
    def decode(self, fields: list[torch.Tensor]) -> torch.Tensor:
        """Inverse of encode, into the model's dtype."""

    @classmethod
    def token_bytes(cls, spec: KVSpec, dtype: torch.dtype) -> int:
        per_layer = sum(math.prod(shape) * _itemsize(dt) for shape, dt in cls.fields(spec, dtype))
        return 2 * spec.num_layers * per_layer

    def __init__(self, spec: KVSpec, num_slots: int, dtype: torch.dtype, device: torch.device):
        super().__init__(spec, num_slots, dtype, device)
        # torch.empty: pages of untouched slots are never committed to memory.
        self.k_fields, self.v_fields = (
            [  # each (layers, slots, *shape)
                torch.empty((spec.num_layers, num_slots, *shape), dtype=dt, device=device)
                for shape, dt in self.fields(spec, dtype)
            ]
            for _ in range(2)
        )

    @property
    def stored(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_fields[0], self.v_fields[0]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.name is not None:
            self.check_finite(layer, keys=k, values=v)
        for store, x in ((self.k_fields, k), (self.v_fields, v)):
            for tensor, encoded in zip(store, self.encode(x)):
                tensor[layer].index_copy_(0, slots, encoded)

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = (
            self.decode([t[layer].index_select(0, slots) for t in store])
            for store in (self.k_fields, self.v_fields)
        )
        return k, v

    def poison(self, slots: torch.Tensor) -> None:
        for tensor in (*self.k_fields, *self.v_fields):
            if tensor.is_floating_point():  # a NaN scale spoils the codes beside it
                tensor[:, slots] = float("nan")

    def _named_fields(self) -> dict[str, torch.Tensor]:
        named = {f"k{i}": t for i, t in enumerate(self.k_fields)}
        return named | {f"v{i}": t for i, t in enumerate(self.v_fields)}

    def export(self, slots: torch.Tensor) -> StoredKV:
        return StoredKV({name: t[:, slots] for name, t in self._named_fields().items()})

    def load(self, slots: torch.Tensor, stored: StoredKV) -> None:
        for name, tensor in self._named_fields().items():
            tensor[:, slots] = stored.tensors[name].to(tensor.device)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# --- float storage ------------------------------------------------------------------------
class ModelDtype(TokenCodec):
    """The baseline: K/V stored in the model's own dtype, exactly (no check, no scale)."""

    describe = "the model's dtype (baseline)"

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
            raise ValueError(f"kv_dtype={self.name!r} cannot hold |x| > {limit:g}: it overflows")
        return (y,)

    def decode(self, fields: list[torch.Tensor]) -> torch.Tensor:
        return fields[0].to(self.dtype)


class FP16(FloatCast):
    """IEEE half. |err| <= 2^-11 |x| (normal range), <= 2^-25 below 2^-14; |x| <= 65504."""

    name, storage, describe = "fp16", torch.float16, "fp16 cast"


class BF16(FloatCast):
    """bfloat16: fp32's range, 8 significant bits. |err| <= 2^-8 |x| (normal range)."""

    name, storage, describe = "bf16", torch.bfloat16, "bf16 cast"


# --- scaled codes -------------------------------------------------------------------------
def _scale(amax: torch.Tensor, top: float) -> torch.Tensor:
    """bf16 scale amax / top (0 where amax is 0, never a subnormal that flushes to 0)."""
    s = (amax.float() / top).clamp(min=torch.finfo(SCALE_DTYPE).tiny)
    return torch.where(amax > 0, s, 0.0).to(SCALE_DTYPE)


def quantize_symmetric(x: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Integer codes in [-qmax, qmax] along the last dim and the bf16 scale: x ~ q * s."""
    x = x.float()
    s = _scale(x.abs().amax(-1), qmax)  # (...,)
    sf = s.float()[..., None]
    q = torch.where(sf > 0, x / sf, 0.0).round().clamp(-qmax, qmax)
    # q may round past qmax by bf16's rounding of s (<= 2^-8 relative); clamping then
    # errs by <= qmax * 2^-8 * s, still under s / 2.
    return q, s


class Int8(TokenCodec):
    """int8, symmetric, one bf16 scale per token per kv head: s = amax / 127.

    |err| <= s / 2 per element (s the stored scale, ~amax/127).
    """

    name, describe = "int8", "int8, scale per token per head"

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


class Float8(TokenCodec):
    """fp8 codes (bits stored as uint8) with one bf16 scale per token per kv head.

    x / s, with s = amax / fp8_max, is cast to fp8 (round to nearest), so the head's
    largest value lands on fp8's largest. Per token per head, like int8, rather than per
    block: a token's scale is final when it is written (nothing to re-quantize later).
    """

    fp8: torch.dtype

    @classmethod
    def fields(cls, spec: KVSpec, dtype: torch.dtype) -> list[Field]:
        heads, dim = spec.num_kv_heads, spec.head_dim
        return [((heads, dim), torch.uint8), ((heads,), SCALE_DTYPE)]

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        top = torch.finfo(self.fp8).max
        x = x.float()
        s = _scale(x.abs().amax(-1), top)
        sf = s.float()[..., None]
        y = torch.where(sf > 0, x / sf, 0.0).clamp(-top, top).to(self.fp8)
        return y.view(torch.uint8), s

    def decode(self, fields: list[torch.Tensor]) -> torch.Tensor:
        q, s = fields
        return (q.view(self.fp8).float() * s.float()[..., None]).to(self.dtype)


class FP8E4M3(Float8):
    """fp8 e4m3 (3 mantissa bits, max 448). |err| <= 2^-4 |x| + 2^-10 s, s ~ amax/448."""

    name, fp8, describe = "fp8_e4m3", torch.float8_e4m3fn, "fp8 e4m3, scale per token per head"


class FP8E5M2(Float8):
    """fp8 e5m2 (2 mantissa bits, max 57344). |err| <= 2^-3 |x| + 2^-17 s, s ~ amax/57344."""

    name, fp8, describe = "fp8_e5m2", torch.float8_e5m2, "fp8 e5m2, scale per token per head"


def group_size(head_dim: int, group: int = 32) -> int:
    """Channels per quantization group along head_dim: `group` if it divides, else all."""
    return group if head_dim % group == 0 else head_dim


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes < 2**bits along the last dim, 8 // bits per uint8 (first in low bits)."""
    per = 8 // bits
    q = q.to(torch.uint8).unflatten(-1, (-1, per))
    out = q[..., 0].clone()
    for i in range(1, per):
        out |= q[..., i] << (bits * i)
    return out


def unpack(p: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of pack: (..., n) uint8 -> (..., n * 8 // bits) uint8 codes."""
    mask = (1 << bits) - 1
    parts = [(p >> (bits * i)) & mask for i in range(8 // bits)]
    return torch.stack(parts, -1).flatten(-2)


class Int4(TokenCodec):
    """int4, symmetric, one bf16 scale per group of 32 channels per token per kv head.

    Codes in [-7, 7] (stored +8, two per uint8). |err| <= s / 2, s ~ group amax / 7.
    Needs an even head_dim; a head_dim that 32 does not divide makes one group per head.
    """

    name, describe = "int4", "int4, scale per 32 channels per token"

    @classmethod
    def fields(cls, spec: KVSpec, dtype: torch.dtype) -> list[Field]:
        heads, dim = spec.num_kv_heads, spec.head_dim
        if dim % 2:
            raise ValueError(f"kv_dtype='int4' packs two codes per byte: head_dim={dim} is odd")
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


def codec_class(kv_dtype: str | None) -> type[KVCodec]:
    """The codec class EngineConfig.kv_dtype names (None: the model's own dtype)."""
    from kvlab.cache.kivi import Kivi2  # kivi builds on the helpers above

    classes: dict[str | None, type[KVCodec]] = {
        c.name: c for c in (ModelDtype, FP16, BF16, Int8, FP8E4M3, FP8E5M2, Int4, Kivi2)
    }
    if kv_dtype not in classes:
        raise ValueError(f"kv_dtype={kv_dtype!r} is unknown; choose None or one of {CODECS}")
    return classes[kv_dtype]


CODECS = ("fp16", "bf16", "int8", "fp8_e4m3", "fp8_e5m2", "int4", "kivi2")


def make_codec(
    kv_dtype: str | None,
    spec: KVSpec,
    num_slots: int,
    dtype: torch.dtype,
    device: torch.device,
) -> KVCodec:
    return codec_class(kv_dtype)(spec, num_slots, dtype, device)
