"""The codec interface: how the pool stores each token's K and V.

A codec owns the pool's storage. It encodes K/V on `write` (quantize), decodes on `gather`
(dequantize, in plain torch) and reports `token_bytes`: the bytes one token costs in every
layer, K and V, **scales included**, so a byte budget buys more slots with a smaller codec.
Block copies (copy-on-write, swap, partial prefix hits) move its stored codes as they are
(`export` / `load`, a `StoredKV`), never decoding and re-encoding.

Capabilities, as class attributes: `alignment` (slots are used in aligned runs of that
many positions), `window_tokens` (tokens per sequence held outside `token_bytes`),
`has_kernel` (kvlab.kernels reads this layout in place), `layerwise` (`export_layer` /
`load_layer` move one layer's codes: KV connectors load and save layer by layer),
`describe` (one line).
Speculative decoding asks `draft_room` (how far drafts may write) and calls `discard`
on rejected drafts' slots.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from kvlab.cache.spec import KVSpec

SCALE_DTYPE = torch.bfloat16
Field = tuple[tuple[int, ...], torch.dtype]  # per-slot shape and dtype of one stored tensor


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


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

    def layer(self, index: int) -> StoredKV:
        """Layer `index`'s share (layer-wise codecs): each tensor (1, n, ...)."""
        return StoredKV({k: t[index : index + 1] for k, t in self.tensors.items()})

    @staticmethod
    def cat(layers: list[StoredKV]) -> StoredKV:
        """Layer shares, in layer order, back into one StoredKV (inverse of `layer`)."""
        names = layers[0].tensors
        return StoredKV({k: torch.cat([part.tensors[k] for part in layers]) for k in names})


class KVCodec(ABC):
    """Stores K and V of `num_slots` token slots in every layer, encoded."""

    name: str | None = None  # set by CODECS.register
    describe: str = ""
    has_kernel: bool = False  # kvlab.kernels reads this layout in place
    alignment: int = 1  # slots are used in aligned runs of this many consecutive positions
    layerwise: bool = False  # export_layer / load_layer move one layer's codes at a time
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

    def export_layer(self, layer: int, slots: torch.Tensor) -> StoredKV:
        """`layer`'s share of `export(slots)` (layer-wise codecs only)."""
        raise NotImplementedError(f"codec {self.name!r} moves every layer at once")

    def load_layer(self, layer: int, slots: torch.Tensor, stored: StoredKV) -> None:
        """Store `stored.layer(layer)`, layer `layer` of what `export` returned, into slots
        (layer-wise codecs only)."""
        raise NotImplementedError(f"codec {self.name!r} moves every layer at once")

    def draft_room(self, position: int) -> int:
        """Most draft tokens a sequence whose next write lands at `position` may write this
        step (speculative decoding). Token-by-token codecs have no limit."""
        return 1 << 30

    def discard(self, slots: torch.Tensor) -> None:
        """Rejected drafts' slots (N,): roll back any state their writes left (a token
        codec has none: the slots are simply overwritten later)."""
        return None

    def check_finite(self, layer: int, **tensors: torch.Tensor) -> None:
        for what, x in tensors.items():
            if x.numel() and not bool(x.abs().amax().isfinite()):  # amax keeps NaN and inf
                raise ValueError(
                    f"kv_codec={self.name!r}: the {what} written to layer {layer} contain NaN "
                    f"or inf; this codec stores finite values only"
                )


class TokenCodec(KVCodec):
    """A codec that encodes each token on its own: a few stored tensors per slot."""

    layerwise = True

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
        per_layer = sum(math.prod(shape) * itemsize(dt) for shape, dt in cls.fields(spec, dtype))
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

    def export_layer(self, layer: int, slots: torch.Tensor) -> StoredKV:
        return StoredKV({n: t[layer : layer + 1, slots] for n, t in self._named_fields().items()})

    def load_layer(self, layer: int, slots: torch.Tensor, stored: StoredKV) -> None:
        for name, tensor in self._named_fields().items():
            tensor[layer, slots] = stored.tensors[name][layer].to(tensor.device)
