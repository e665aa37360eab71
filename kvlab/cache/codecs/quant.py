"""Quantization helpers the scaled codecs share: bf16 scales, symmetric and asymmetric
integer codes, and bit packing."""

from __future__ import annotations

import torch

from kvlab.cache.codecs.base import SCALE_DTYPE


def scale_for(amax: torch.Tensor, top: float) -> torch.Tensor:
    """bf16 scale amax / top (0 where amax is 0, never a subnormal that flushes to 0)."""
    s = (amax.float() / top).clamp(min=torch.finfo(SCALE_DTYPE).tiny)
    return torch.where(amax > 0, s, 0.0).to(SCALE_DTYPE)


def quantize_symmetric(x: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Integer codes in [-qmax, qmax] along the last dim and the bf16 scale: x ~ q * s."""
    x = x.float()
    s = scale_for(x.abs().amax(-1), qmax)  # (...,)
    sf = s.float()[..., None]
    q = torch.where(sf > 0, x / sf, 0.0).round().clamp(-qmax, qmax)
    # q may round past qmax by bf16's rounding of s (<= 2^-8 relative); clamping then
    # errs by <= qmax * 2^-8 * s, still under s / 2.
    return q, s


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
