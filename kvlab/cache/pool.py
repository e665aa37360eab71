"""The physical KV storage every cache variant writes into: a flat pool of token slots."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
    which slots they hand to which sequence; the pool just stores and gathers.
    """

    def __init__(self, spec: KVSpec, num_slots: int, dtype: torch.dtype, device: torch.device):
        self.spec, self.num_slots, self.dtype, self.device = spec, num_slots, dtype, device
        shape = (spec.num_layers, num_slots, spec.num_kv_heads, spec.head_dim)
        # torch.empty: pages of untouched slots are never committed to memory.
        self.k = torch.empty(
            shape, dtype=dtype, device=device
        )  # (layers, slots, kv_heads, head_dim)
        self.v = torch.empty(shape, dtype=dtype, device=device)

    @property
    def bytes_per_token(self) -> int:
        return self.spec.bytes_per_token(self.dtype)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' K/V. slots: (T,) int64; k, v: (T, kv_heads, head_dim)."""
        self.k[layer].index_copy_(0, slots, k.to(self.dtype))
        self.v[layer].index_copy_(0, slots, v.to(self.dtype))

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of the given slots. slots: (B, S) int64 -> k, v: (B, S, kv_heads, head_dim)."""
        flat = slots.reshape(-1)
        shape = (*slots.shape, self.spec.num_kv_heads, self.spec.head_dim)
        k = self.k[layer].index_select(0, flat).view(shape)
        v = self.v[layer].index_select(0, flat).view(shape)
        return k, v

    def poison(self, slots: torch.Tensor) -> None:
        """Fill slots with NaN (debug mode): any later read of them corrupts the output."""
        self.k[:, slots] = float("nan")
        self.v[:, slots] = float("nan")
