"""KIVI-style 2-bit KV: keys quantized per channel, values per token, recent tokens exact.

Why per channel: a few key channels are large in every token (outlier channels), so a
per-token scale sized for them crushes every other channel to zero. Quantizing each
channel over a run of tokens gives each channel its own range (Liu et al., KIVI, 2024).

How it works with a pool of slots, where tokens arrive one at a time:

- Slots are taken in aligned *groups* of G = 16 (`alignment`; one block at the default
  block_size). In both caches a group holds G consecutive positions of one sequence.
- Values: 2-bit codes with a bf16 scale and zero point per 32 channels per token,
  written at once.
- Keys: while a group is incomplete, its K and V live in a full-precision *window*
  buffer (the model's dtype) and reads take them from there: each sequence's most recent
  0..G-1 tokens are exact. When the group's last slot is written, its keys get one
  scale and zero point per channel over the G tokens, and the window buffer is freed.
  A group written whole (prefill) is quantized directly, without a window buffer.

Accounting: `token_bytes` counts codes and scales (per-channel key scales amortized over
G tokens). The window is a per-sequence overhead outside it: at most G x the model-dtype
bytes per token, per running sequence (`window_bytes` reports what is allocated). The
pool is not told when a sequence ends, so an unfinished group's buffer is reclaimed when
its group is next written from its first slot (or poisoned), not at once.

Error: asymmetric, 4 levels: |err| <= s / 2 with s ~ (max - min) / 3 over the channel's
group (keys) or the token's 32 channels (values); window tokens are exact. Finite
inputs with |x| <= 1e38 only.
"""

from __future__ import annotations

import math

import torch

from kvlab.cache.codecs.base import SCALE_DTYPE, KVCodec, KVSpec, StoredKV
from kvlab.cache.codecs.quant import group_size, pack, scale_for, unpack
from kvlab.cache.codecs.registry import CODECS

LEVELS = 3  # 2 bits: codes 0..3


def quantize_asymmetric(
    x: torch.Tensor, dim: int, levels: int = LEVELS
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes in [0, levels] along `dim`, and bf16 scale s and zero z: x ~ z + q * s.

    z is min(x) rounded *down* to bf16, so every x sits at or above it.
    """
    x = x.float()
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    z = lo.to(SCALE_DTYPE)
    z = torch.where(z.float() > lo, torch.nextafter(z, torch.full_like(z, -math.inf)), z)
    s = scale_for(hi - z.float(), levels)
    sf = s.float()
    q = torch.where(sf > 0, (x - z.float()) / sf, 0.0).round().clamp(0, levels)
    return q, s, z


def dequantize_asymmetric(q: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    return z.float() + q.float() * s.float()


@CODECS.register("kivi2")
class Kivi2(KVCodec):
    """2-bit keys per channel over 16-token groups, 2-bit values per token, exact window."""

    describe = "2-bit: keys per channel (16-token groups), values per token"
    group = 16  # G: positions per key group
    alignment = group
    window_tokens = group - 1  # in the model's dtype, per running sequence

    @classmethod
    def token_bytes(cls, spec: KVSpec, dtype: torch.dtype) -> int:
        heads, dim = spec.num_kv_heads, spec.head_dim
        scale_bytes = 2 * torch.finfo(SCALE_DTYPE).bits // 8  # a scale and a zero point
        codes = heads * dim // 4  # 2 bits each, for K and again for V
        key_scales = heads * dim * scale_bytes / cls.group  # per channel per group
        value_scales = heads * (dim // group_size(dim)) * scale_bytes  # per token
        return math.ceil(spec.num_layers * (2 * codes + key_scales + value_scales))

    def __init__(self, spec: KVSpec, num_slots: int, dtype: torch.dtype, device: torch.device):
        super().__init__(spec, num_slots, dtype, device)
        layers, heads, dim, g = spec.num_layers, spec.num_kv_heads, spec.head_dim, self.group
        if dim % 4:
            raise ValueError(f"kv_codec='kivi2' packs 4 codes per byte: head_dim={dim} % 4 != 0")
        if num_slots % g:
            raise ValueError(f"kv_codec='kivi2' needs a multiple of {g} slots, got {num_slots}")
        self.num_groups, self.value_group = num_slots // g, group_size(dim)

        def empty(*shape: int, dtype: torch.dtype = SCALE_DTYPE) -> torch.Tensor:
            return torch.empty(shape, dtype=dtype, device=device)

        self.k_codes = empty(layers, num_slots, heads, dim // 4, dtype=torch.uint8)
        self.k_scale = empty(layers, self.num_groups, heads, dim)  # per channel per group
        self.k_zero = empty(layers, self.num_groups, heads, dim)
        self.v_codes = empty(layers, num_slots, heads, dim // 4, dtype=torch.uint8)
        self.v_scale = empty(layers, num_slots, heads, dim // self.value_group)
        self.v_zero = empty(layers, num_slots, heads, dim // self.value_group)
        # The window: full-precision K/V of incomplete groups, one buffer per group.
        self.window = empty(0, 2, layers, g, heads, dim, dtype=dtype)  # (buf, K/V, L, G, H, D)
        self.filled = torch.zeros(0, layers, g, dtype=torch.bool, device=device)
        self.staged = torch.full((layers, self.num_groups), -1, device=device)  # group -> buf
        self.buffer_of: dict[int, int] = {}
        self.free_buffers: list[int] = []

    @property
    def stored(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_codes, self.v_codes

    @property
    def window_bytes(self) -> int:
        """Bytes of full-precision window buffers allocated now."""
        return self.window.numel() * self.window.element_size()

    # --- write --------------------------------------------------------------------------
    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.check_finite(layer, keys=k, values=v)
        q, s, z = quantize_asymmetric(v.unflatten(-1, (-1, self.value_group)), dim=-1)
        self.v_codes[layer].index_copy_(0, slots, pack(q.flatten(-2), 2))
        self.v_scale[layer].index_copy_(0, slots, s.squeeze(-1))
        self.v_zero[layer].index_copy_(0, slots, z.squeeze(-1))

        g = self.group
        groups = slots // g
        ids, counts = torch.unique(groups, return_counts=True)
        whole = ids[counts == g]  # groups this call writes completely
        if len(whole):
            rows = torch.isin(groups, whole)
            order = slots[rows].argsort()  # slot order = group by group, position order
            self._store_keys(layer, whole, k[rows][order].unflatten(0, (len(whole), g)))
        partial, done = ids[counts < g], whole
        if len(partial):
            rows = ~torch.isin(groups, whole)
            finished = self._stage(layer, partial, groups[rows], slots[rows] % g, k[rows], v[rows])
            done = torch.cat([whole, finished])
        if layer == self.spec.num_layers - 1:
            self._release(done.tolist())

    def _stage(
        self,
        layer: int,
        partial: torch.Tensor,
        groups: torch.Tensor,
        offsets: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> torch.Tensor:
        """Copy rows of incomplete groups into their window buffers; quantize the keys of
        groups this completes and return those groups."""
        bufs = torch.tensor([self._buffer(gr) for gr in partial.tolist()], dtype=torch.long)
        bufs = bufs.to(self.device)
        row_bufs = bufs[torch.searchsorted(partial, groups)]
        self.filled[row_bufs[offsets == 0], layer] = False  # a group (re)starts
        self.window[row_bufs, 0, layer, offsets] = k.to(self.dtype)
        self.window[row_bufs, 1, layer, offsets] = v.to(self.dtype)
        self.filled[row_bufs, layer, offsets] = True
        self.staged[layer, partial] = bufs
        complete = self.filled[bufs, layer].all(-1)
        if bool(complete.any()):
            self._store_keys(layer, partial[complete], self.window[bufs[complete], 0, layer])
        return partial[complete]

    def _store_keys(self, layer: int, groups: torch.Tensor, keys: torch.Tensor) -> None:
        """Quantize complete groups' keys per channel. keys: (n, G, heads, head_dim)."""
        q, s, z = quantize_asymmetric(keys, dim=1)  # s, z: (n, 1, heads, head_dim)
        slots = groups[:, None] * self.group + torch.arange(self.group, device=self.device)
        self.k_codes[layer].index_copy_(0, slots.reshape(-1), pack(q, 2).flatten(0, 1))
        self.k_scale[layer].index_copy_(0, groups, s.squeeze(1))
        self.k_zero[layer].index_copy_(0, groups, z.squeeze(1))
        self.staged[layer, groups] = -1

    def _buffer(self, group: int) -> int:
        if group in self.buffer_of:
            return self.buffer_of[group]
        if not self.free_buffers:
            n = self.window.shape[0]
            grow = max(4, n)
            more = torch.empty((grow, *self.window.shape[1:]), dtype=self.dtype, device=self.device)
            self.window = torch.cat([self.window, more])
            self.filled = torch.cat(
                [self.filled, self.filled.new_zeros(grow, *self.filled.shape[1:])]
            )
            self.free_buffers.extend(range(n + grow - 1, n - 1, -1))
        buf = self.free_buffers.pop()
        self.filled[buf] = False
        self.buffer_of[group] = buf
        return buf

    def _release(self, groups: list[int]) -> None:
        for group in groups:
            buf = self.buffer_of.pop(group, None)
            if buf is not None:
                self.free_buffers.append(buf)

    # --- speculative drafts -----------------------------------------------------------
    def draft_room(self, position: int) -> int:
        """Drafts never complete a key group: a group quantized over rejected tokens could
        not be rolled back (its window is gone), so drafting stops one short of the
        group's last slot, and the ordinary write of that slot completes it."""
        return max(0, self.group - 2 - position % self.group)

    def discard(self, slots: torch.Tensor) -> None:
        """Unmark rejected drafts in their group's window: the group stays incomplete."""
        bufs = self.staged[:, slots // self.group]  # (L, N)
        layer, col = (bufs >= 0).nonzero(as_tuple=True)
        self.filled[bufs[layer, col], layer, slots[col] % self.group] = False

    # --- read ---------------------------------------------------------------------------
    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        groups = slots // self.group
        kq = unpack(self.k_codes[layer].index_select(0, slots), 2)  # (N, heads, head_dim)
        k = dequantize_asymmetric(
            kq,
            self.k_scale[layer].index_select(0, groups),
            self.k_zero[layer].index_select(0, groups),
        )
        vq = unpack(self.v_codes[layer].index_select(0, slots), 2)
        v = dequantize_asymmetric(
            vq.unflatten(-1, (-1, self.value_group)),
            self.v_scale[layer].index_select(0, slots)[..., None],
            self.v_zero[layer].index_select(0, slots)[..., None],
        ).flatten(-2)
        k, v = k.to(self.dtype), v.to(self.dtype)
        bufs = self.staged[layer].index_select(0, groups)
        exact = bufs >= 0  # tokens of incomplete groups: read from the window
        if bool(exact.any()):
            offsets = slots % self.group
            exact &= self.filled[bufs.clamp(min=0), layer, offsets]
            b, o = bufs[exact], offsets[exact]
            k[exact] = self.window[b, 0, layer, o]
            v[exact] = self.window[b, 1, layer, o]
        return k, v

    # --- copies of stored codes -------------------------------------------------------
    def _groups_of(self, slots: torch.Tensor) -> torch.Tensor:
        """Key groups of `slots`, which must run group-aligned: slot i at offset i % G."""
        offsets = torch.arange(len(slots), device=slots.device) % self.group
        if not bool((slots % self.group == offsets).all()):
            raise ValueError("kivi2 copies slots in runs that start at a 16-token group")
        return slots[:: self.group] // self.group

    def export(self, slots: torch.Tensor) -> StoredKV:
        """Per slot: codes and value scales; per key group: its scales, or (incomplete
        groups) its window of exact K/V. A complete group must be copied whole."""
        groups, count = self._groups_of(slots), len(slots)
        staged = self.staged[:, groups]  # (L, n)
        window = torch.zeros((len(groups), *self.window.shape[1:]), dtype=self.dtype,
                             device=self.device)  # fmt: skip
        filled = torch.zeros((len(groups), *self.filled.shape[1:]), dtype=torch.bool,
                             device=self.device)  # fmt: skip
        for layer, i in (staged >= 0).nonzero().tolist():
            buf = int(staged[layer, i])
            window[i, :, layer] = self.window[buf, :, layer]
            filled[i, layer] = self.filled[buf, layer]
        last = count - (len(groups) - 1) * self.group  # slots of the last group copied
        if last < self.group:
            if not bool((staged[:, -1] >= 0).all()):
                raise ValueError("kivi2 copies a complete key group whole, never a part of it")
            filled[-1, :, last:] = False
        return StoredKV(
            {
                "k_codes": self.k_codes[:, slots],
                "v_codes": self.v_codes[:, slots],
                "v_scale": self.v_scale[:, slots],
                "v_zero": self.v_zero[:, slots],
                "k_scale": self.k_scale[:, groups],
                "k_zero": self.k_zero[:, groups],
                "staged": (staged >= 0).to(torch.int8),
                "window": window,
                "filled": filled,
            }
        )

    def load(self, slots: torch.Tensor, stored: StoredKV) -> None:
        t = {name: x.to(self.device) for name, x in stored.tensors.items()}
        groups = self._groups_of(slots)
        for name in ("k_codes", "v_codes", "v_scale", "v_zero"):
            getattr(self, name)[:, slots] = t[name]
        self.k_scale[:, groups], self.k_zero[:, groups] = t["k_scale"], t["k_zero"]
        self.staged[:, groups] = -1
        staged = t["staged"].bool()  # (L, n)
        self._release([g for i, g in enumerate(groups.tolist()) if not staged[:, i].any()])
        for i, group in enumerate(groups.tolist()):
            if staged[:, i].any():
                buf = self._buffer(group)
                self.window[buf], self.filled[buf] = t["window"][i], t["filled"][i]
                self.staged[staged[:, i], group] = buf

    def poison(self, slots: torch.Tensor) -> None:
        groups = torch.unique(slots // self.group)
        self.k_scale[:, groups] = float("nan")
        self.v_scale[:, slots] = float("nan")
        self.staged[:, groups] = -1
        self._release(groups.tolist())
