"""Decode attention on AMX tiles (kernels/cpu_decode_amx.c) against plain torch, against
the vector path, and where it is chosen.

The cases reuse test_cpu_decode's paged pool (blocks of 16 slots in random order, every slot
no sequence uses NaN) and its fp32 reference. They cross the kernel's tiles: 16 positions
per tile (a block's consecutive slots read in place, a sequence's last partial block and
scattered slots gathered), 256 per task, query rows in groups of 16 per kv head (a
shared chunk's members side by side), head sizes of one to eight 32-wide steps. The kernel's
tests run only where the CPU has AMX-BF16; the argument checks run everywhere.
"""

from __future__ import annotations

import pytest
import torch
from kvlab.kernels import cpu_kernels_available, cpu_paged_decode_attention
from kvlab.kernels.cpu_prefill import amx_ready
from test_cpu_decode import paged_case, reference

needs_amx = pytest.mark.skipif(
    not (cpu_kernels_available() and amx_ready()), reason="needs a CPU with AMX-BF16"
)


def tiles_match(q, k, v, slots, lens, scale=0.125):
    out = cpu_paged_decode_attention(q, k, v, slots, lens, scale, amx=True)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    assert torch.isfinite(out).all(), "NaN from a slot no sequence uses leaked in"
    expected = reference(q, k, v, slots, lens, scale)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=0)
    return out


@needs_amx
@pytest.mark.parametrize(
    "heads, kv_heads, dim", [(9, 3, 64), (8, 2, 128), (4, 4, 32), (12, 4, 96), (4, 1, 256)]
)
def test_matches_torch_across_head_shapes(heads, kv_heads, dim):
    tiles_match(*paged_case(7, heads, kv_heads, dim, torch.bfloat16, seed=dim, max_len=700))


@needs_amx
@pytest.mark.parametrize("length", [1, 15, 16, 17, 255, 256, 257, 300])
def test_lengths_across_tiles_and_chunks(length):
    """Whole blocks read in place, a last partial block gathered (zeros past the end)."""
    q, k, v, slots, lens = paged_case(4, 9, 3, 64, torch.bfloat16, seed=length, max_len=900)
    lens = lens.clamp(max=length)  # shorter than drawn: the slots past it are still its own
    assert (lens == length).any()
    tiles_match(q, k, v, slots, lens)


@needs_amx
def test_scattered_slots_are_gathered():
    """No block of consecutive slots: every tile of positions is gathered."""
    q, k, v, slots, lens = paged_case(4, 9, 3, 64, torch.bfloat16, seed=3, max_len=600)
    gen = torch.Generator().manual_seed(4)
    for b, n in enumerate(lens.tolist()):  # each sequence's own slots, shuffled
        slots[b, :n] = slots[b, torch.randperm(n, generator=gen)]
    tiles_match(q, k, v, slots, lens)


@needs_amx
def test_the_same_bits_alone_in_company_and_for_any_thread_count():
    """Sequences sharing a prefix's slots (one task serves up to 16 of them, their rows in
    several groups of 16 per kv head) give each the bits it gives alone; threads do not
    change them; the vector path agrees up to the weights' bf16 rounding."""
    q, k, v, slots, lens = paged_case(20, 9, 3, 64, torch.bfloat16, seed=15, max_len=1100)
    lens = lens.clamp(min=720)
    slots[:, :600] = slots[0, :600]
    used = torch.zeros(k.shape[0], dtype=torch.bool)
    used[slots[torch.arange(slots.shape[1])[None, :] < lens[:, None]]] = True
    gen = torch.Generator().manual_seed(16)
    k, v = (torch.randn(k.shape, generator=gen).bfloat16() for _ in range(2))
    k[~used], v[~used] = float("nan"), float("nan")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = tiles_match(q, k, v, slots, lens)
        torch.set_num_threads(max(2, threads))
        together = tiles_match(q, k, v, slots, lens)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, together)
    alone = [
        cpu_paged_decode_attention(q[b : b + 1], k, v, slots[b : b + 1], lens[b : b + 1],
                                   0.125, amx=True)
        for b in range(20)
    ]  # fmt: skip
    assert torch.equal(together, torch.cat(alone))
    vector = cpu_paged_decode_attention(q, k, v, slots, lens, 0.125, amx=False)
    torch.testing.assert_close(together.float(), vector.float(), atol=2e-2, rtol=0)


@needs_amx
def test_the_default_is_tiles_for_bf16_and_the_vector_path_still_matches():
    q, k, v, slots, lens = paged_case(6, 9, 3, 64, torch.bfloat16, seed=8, max_len=500)
    default = cpu_paged_decode_attention(q, k, v, slots, lens, 0.125)
    assert torch.equal(default, tiles_match(q, k, v, slots, lens))
    vector = cpu_paged_decode_attention(q, k, v, slots, lens, 0.125, amx=False)
    torch.testing.assert_close(
        vector.float(), reference(q, k, v, slots, lens, 0.125), atol=2e-2, rtol=0
    )


@pytest.mark.parametrize(
    "dtype, dim, scale",
    [(torch.float32, 64, 0.125), (torch.bfloat16, 48, 0.125), (torch.bfloat16, 64, -1.0)],
)
def test_tiles_asked_for_what_they_cannot_compute_raise(dtype, dim, scale):
    q, k, v, slots, lens = paged_case(2, 4, 2, dim, dtype, seed=1, max_len=40)
    with pytest.raises(ValueError, match="amx=True needs bf16"):
        cpu_paged_decode_attention(q, k, v, slots, lens, scale, amx=True)
