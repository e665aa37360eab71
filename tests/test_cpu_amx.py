"""The bf16 prompt kernel on AMX tiles (kernels/cpu_amx.c) against plain torch, and where
it is chosen.

The cases reuse test_cpu_prefill's paged pool (blocks scrambled, every slot the sequence
does not own NaN) and its fp32 reference. The shapes cross the kernel's tiles: 32 query
positions per task (times the query heads of a kv head, padded to 32 rows), 256 key
positions per chunk, 32 per step of the tile unit, head sizes of one to eight 32-wide
steps. The tests of the kernel itself run only where the CPU has AMX-BF16; the dispatch
tests run everywhere.
"""

from __future__ import annotations

import pytest
import torch
from kvlab.kernels import cpu_build, cpu_kernels_available, cpu_paged_prefill_attention
from kvlab.kernels.cpu_prefill import amx_ready, on_amx
from test_cpu_prefill import paged_case, reference

needs_amx = pytest.mark.skipif(
    not (cpu_kernels_available() and amx_ready()), reason="needs a CPU with AMX-BF16"
)


def amx_matches(q, k, v, slots, scale=0.125):
    out = cpu_paged_prefill_attention(q, k, v, slots, scale, amx=True)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    assert torch.isfinite(out).all(), "NaN from a slot the sequence does not own leaked in"
    torch.testing.assert_close(out.float(), reference(q, k, v, slots, scale), atol=2e-2, rtol=0)
    return out


@needs_amx
@pytest.mark.parametrize(
    "rows, cached",
    [(1, 0), (1, 40), (5, 0), (31, 0), (32, 0), (33, 95), (40, 300), (129, 0), (300, 0),
     (70, 250), (1, 1000)],
)  # fmt: skip
def test_matches_torch(rows, cached):
    amx_matches(*paged_case(rows, cached, 9, 3, 64, torch.bfloat16, seed=rows + cached))


@needs_amx
@pytest.mark.parametrize(
    "heads, kv_heads, dim",
    [(4, 4, 64), (8, 2, 128), (6, 1, 32), (4, 2, 96), (2, 1, 256), (32, 4, 64)],
)
def test_head_layouts_and_sizes(heads, kv_heads, dim):
    """Plain MHA, groups of 4, 6 and 8 query heads, and head sizes of 1 to 8 steps."""
    amx_matches(*paged_case(23, 141, heads, kv_heads, dim, torch.bfloat16, seed=dim))


@needs_amx
def test_sharp_softmax_and_a_running_max_that_grows():
    """Large scores, and later chunks with larger maxima than earlier ones, so the
    accumulator is rescaled on the way."""
    q, k, v, slots = paged_case(40, 600, 9, 3, 64, torch.float32, seed=8)
    k[slots] = k[slots] * torch.linspace(0.5, 3.0, len(slots))[:, None, None]
    amx_matches(q.bfloat16(), k.bfloat16(), v.bfloat16(), slots, scale=1.0)


@needs_amx
def test_close_to_the_fp32_tiles_and_the_same_bits_for_any_thread_count():
    """The AMX kernel and the fp32 register tiles differ by the weights' bf16 rounding only;
    each row's bits depend on the shapes, never on the thread count or its block mates."""
    q, k, v, slots = paged_case(300, 500, 9, 3, 64, torch.bfloat16, seed=9)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = amx_matches(q, k, v, slots)
        torch.set_num_threads(max(2, threads))
        multi = amx_matches(q, k, v, slots)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, multi)
    tiles = cpu_paged_prefill_attention(q, k, v, slots, 0.125, amx=False)
    torch.testing.assert_close(single.float(), tiles.float(), atol=2e-2, rtol=0)
    later = cpu_paged_prefill_attention(q[37:], k, v, slots, 0.125, amx=True)  # a later chunk
    assert torch.equal(later, single[37:])


@needs_amx
def test_the_default_is_amx_for_bf16_only():
    q, k, v, slots = paged_case(20, 30, 4, 2, 64, torch.bfloat16, seed=5)
    assert on_amx(q, k) and not on_amx(q.float(), k.float()) and not on_amx(q, k.float())
    assert torch.equal(
        cpu_paged_prefill_attention(q, k, v, slots, 0.125),
        cpu_paged_prefill_attention(q, k, v, slots, 0.125, amx=True),
    )


def test_amx_refuses_what_it_cannot_compute():
    if not cpu_kernels_available():
        pytest.skip("the native CPU kernels are unavailable")
    q, k, v, slots = paged_case(8, 8, 4, 2, 48, torch.bfloat16, seed=2)
    with pytest.raises(ValueError, match="head_dim in 32, 64"):
        cpu_paged_prefill_attention(q, k, v, slots, 0.125, amx=True)
    q, k, v, slots = paged_case(8, 8, 4, 2, 64, torch.float32, seed=2)
    with pytest.raises(ValueError, match="bf16"):
        cpu_paged_prefill_attention(q, k, v, slots, 0.125, amx=True)
    if not amx_ready():
        with pytest.raises(ValueError, match="no AMX-BF16"):
            cpu_paged_prefill_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), slots,
                                        0.125, amx=True)  # fmt: skip


def test_bf16_prompts_go_where_they_run_fastest(monkeypatch):
    """bf16: the AMX kernel where it runs; on a CPU with AMX-BF16 but no AMX kernel (an OS
    that refuses the tiles, a build without them), torch's attention on oneDNN's AMX
    kernels; on any other CPU (AVX512-BF16 without AMX, or no bf16 instructions) the
    register tiles where the build fits them, as in fp32."""
    from kvlab.kernels import cpu_prefill

    if not cpu_kernels_available():
        pytest.skip("the native CPU kernels are unavailable")
    q, k, _, _ = paged_case(8, 8, 4, 2, 64, torch.bfloat16, seed=2)
    amx_cpu = "amx_bf16" in cpu_build.cpu_flags()
    tiles = cpu_prefill.prefill_pays()
    assert cpu_prefill.prompt_pays(q, k) == (amx_ready() or (not amx_cpu and tiles))
    assert cpu_prefill.prompt_pays(q.float(), k.float()) == tiles
    monkeypatch.setattr(cpu_prefill, "on_amx", lambda q, k_cache: False)
    for flags, kernel in (({"avx512_bf16", "amx_bf16"}, False), ({"avx512_bf16"}, tiles),
                          (set(), tiles)):  # fmt: skip
        monkeypatch.setattr(cpu_prefill, "cpu_flags", lambda flags=flags: flags)
        assert cpu_prefill.prompt_pays(q, k) == kernel
        assert cpu_prefill.prompt_pays(q.float(), k.float()) == tiles
