"""The physical KV storage every cache variant writes into: a flat pool of token slots."""

from __future__ import annotations

import torch

from kvlab.cache.codecs import StoredKV, make_codec
from kvlab.cache.spec import KVSpec


class KVPool:
    """K and V for `num_slots` token slots in every layer.

    A slot holds one token's K and V for all kv heads. Cache variants differ only in
    which slots they hand to which sequence; the pool just stores and gathers, through a
    codec (kvlab.cache.codecs) that decides how: `kv_codec` None keeps the model's dtype.
    """

    def __init__(
        self,
        spec: KVSpec,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device,
        kv_codec: str | None = None,
    ):
        self.spec, self.num_slots, self.dtype, self.device = spec, num_slots, dtype, device
        self.kv_codec = kv_codec
        self.codec = make_codec(kv_codec, spec, num_slots, dtype, device)

    @property
    def bytes_per_token(self) -> int:
        """One token's K and V in every layer, scales included."""
        return self.codec.token_bytes(self.spec, self.dtype)

    @property
    def k(self) -> torch.Tensor:
        """Stored K, (layers, slots, ...): values for the model's dtype, codes otherwise."""
        return self.codec.stored[0]

    @property
    def v(self) -> torch.Tensor:
        return self.codec.stored[1]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' K/V. slots: (T,) int64; k, v: (T, kv_heads, head_dim)."""
        self.codec.write(layer, slots, k, v)

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of the given slots. slots: (B, S) int64 -> k, v: (B, S, kv_heads, head_dim)."""
        shape = (*slots.shape, self.spec.num_kv_heads, self.spec.head_dim)
        k, v = self.codec.gather(layer, slots.reshape(-1))
        return k.view(shape), v.view(shape)

    @torch.inference_mode()
    def copy(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """Copy-on-write: the stored codes of `source` slots into `target` slots, in every
        layer, bit for bit (no decode and re-encode)."""
        self.codec.copy(source, target)

    @torch.inference_mode()
    def read(self, slots: torch.Tensor) -> StoredKV:
        """The stored codes of `slots` in every layer, copied to host memory (swap-out)."""
        return self.codec.export(slots).to("cpu")

    @torch.inference_mode()
    def restore(self, slots: torch.Tensor, saved: StoredKV) -> None:
        """Write what `read` returned into (other) slots (swap-in)."""
        self.codec.load(slots, saved)

    @torch.inference_mode()
    def read_layer(self, layer: int, slots: torch.Tensor) -> StoredKV:
        """`read(slots)`, one layer's share (codecs with `layerwise`)."""
        return self.codec.export_layer(layer, slots).to("cpu")

    @torch.inference_mode()
    def restore_layer(self, layer: int, slots: torch.Tensor, saved: StoredKV) -> None:
        """`restore`, one layer at a time: layer `layer` of `saved` (all layers)."""
        self.codec.load_layer(layer, slots, saved)

    @property
    def layerwise(self) -> bool:
        """Whether KV moves one layer at a time (`read_layer` / `restore_layer`)."""
        return self.codec.layerwise

    @torch.inference_mode()
    def discard(self, slots: torch.Tensor) -> None:
        """Rejected speculative drafts' slots: the codec rolls back what their writes left."""
        self.codec.discard(slots)

    @torch.inference_mode()
    def poison(self, slots: torch.Tensor) -> None:
        """Fill slots with NaN (debug mode): any later read of them corrupts the output."""
        self.codec.poison(slots)
