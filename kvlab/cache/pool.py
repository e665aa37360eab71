"""The physical KV storage every cache variant writes into: a flat pool of token slots."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.cache.codecs import make_codec


@dataclass(frozen=True)
class KVSpec:
    """Shape of one model's KV: what a single token costs in every layer."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x bytes per element."""
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element


class KVPool:
    """K and V for `num_slots` token slots in every layer.

    A slot holds one token's K and V for all kv heads. Cache variants differ only in
    which slots they hand to which sequence; the pool just stores and gathers, through a
    codec (kvlab.cache.codecs) that decides how: `kv_dtype` None keeps the model's dtype.
    """

    def __init__(
        self,
        spec: KVSpec,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device,
        kv_dtype: str | None = None,
    ):
        self.spec, self.num_slots, self.dtype, self.device = spec, num_slots, dtype, device
        self.kv_dtype = kv_dtype
        self.codec = make_codec(kv_dtype, spec, num_slots, dtype, device)

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

    def copy(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """Copy-on-write: K/V of `source` slots into `target` slots, in every layer.

        Goes through the codec (decode, then encode again), so it works for every codec;
        for the model's own dtype it is an exact copy.
        """
        for layer in range(self.spec.num_layers):
            k, v = self.codec.gather(layer, source)
            self.codec.write(layer, target, k, v)

    def read(self, slots: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """K/V of `slots` in every layer, copied to host memory (swap-out)."""
        return [
            tuple(x.to("cpu", copy=True) for x in self.codec.gather(layer, slots))
            for layer in range(self.spec.num_layers)
        ]

    def restore(self, slots: torch.Tensor, saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write what `read` returned into (other) slots (swap-in)."""
        for layer, (k, v) in enumerate(saved):
            self.codec.write(layer, slots, k.to(self.device), v.to(self.device))

    def poison(self, slots: torch.Tensor) -> None:
        """Fill slots with NaN (debug mode): any later read of them corrupts the output."""
        self.codec.poison(slots)
