"""A decode step's linears streamed (kernels/cpu_stream.c) against float64 torch, and the
runner that uses them, in fp32 and (where the build has AVX512-BF16) bf16.

Each output is one fp32 chain over K in order (bf16: over K's pairs, then rounded to bf16
once), so it is the float64 product to within fp32 rounding of a sum of K terms (bf16: and
one rounding to bf16). The shapes cross the kernel's blocks: rows in one block or in equal
blocks of up to 14 (bf16: 16; 12 with AVX2), each over 4, 3, 2 or 1 panels at once (1, 3,
7, 12, 15, 16, 17 and 32 rows), a task's last panels fewer than that, an odd K (fp32).
The runner's tests need the build `stream_pays` for.
"""

from __future__ import annotations

import pytest
import torch
from kvlab.kernels import cpu_kernels_available
from kvlab.kernels.cpu_prefill import amx_ready
from kvlab.kernels.cpu_stream import (
    MAX_ROWS,
    PackedStream,
    cpu_stream_linear,
    stream_fits,
    stream_pays,
    stream_width,
)
from transformers import LlamaConfig, LlamaForCausalLM

from kvlab.cache.pool import KVPool
from kvlab.model.linear import Linears, StreamLinears
from kvlab.model.metadata import build_attention_metadata
from kvlab.model.runner import ModelRunner

needs_kernels = pytest.mark.skipif(not cpu_kernels_available(), reason="no native kernels")
needs_stream = pytest.mark.skipif(
    not (cpu_kernels_available() and stream_pays()), reason="needs a build with FMA vectors"
)
needs_bf16 = pytest.mark.skipif(
    not (cpu_kernels_available() and stream_width(torch.bfloat16)),
    reason="needs a build with AVX512-BF16",
)
ROWS = [1, 3, 7, 12, 15, 16, 17, 32]
SHAPES = [(960, 576, False), (576, 1536, True), (48, 6, True)]  # n, k, bias


def f32(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@needs_kernels
def test_packing_puts_each_weight_where_the_stream_reads_it():
    """packed[(p K + kk) V + c] = W[p V + c][kk]"""
    v = stream_width()
    n, k = 3 * v, 5
    w = torch.arange(n * k, dtype=torch.float32).view(n, k)
    panels = PackedStream.pack(w).panels.view(n // v, k, v)
    assert torch.equal(panels, w.view(n // v, v, k).transpose(1, 2))


@needs_bf16
def test_bf16_packing_puts_each_pair_where_the_stream_reads_it():
    """packed[((p K/2 + kp) 16 + c) 2 + j] = W[16 p + c][2 kp + j]"""
    n, k = 32, 6
    w = torch.arange(n * k, dtype=torch.bfloat16).view(n, k)  # exact below 256
    panels = PackedStream.pack(w).panels.view(n // 16, k // 2, 16, 2)
    assert torch.equal(panels, w.view(n // 16, 16, k // 2, 2).transpose(1, 2))


@needs_kernels
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n, k, bias", [(960, 576, False), (576, 1536, True), (48, 7, True)])
def test_matches_float64_torch(rows, n, k, bias):
    x, w = f32(rows, k, seed=rows), f32(n, k, seed=n + k)
    b = f32(n, seed=7) if bias else None
    out = cpu_stream_linear(x, PackedStream.pack(w), b)
    expected = x.double() @ w.double().T + (b.double() if bias else 0)
    assert out.shape == (rows, n) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, atol=1e-4 * k**0.5, rtol=1e-5)


@needs_bf16
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n, k, bias", SHAPES)
def test_bf16_matches_float64_torch_to_one_rounding(rows, n, k, bias):
    x, w = f32(rows, k, seed=rows).bfloat16(), f32(n, k, seed=n + k).bfloat16()
    b = f32(n, seed=7).bfloat16() if bias else None
    out = cpu_stream_linear(x, PackedStream.pack(w), b)
    exact = x.double() @ w.double().T + (b.double() if bias else 0)
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), exact, atol=1e-4 * k**0.5, rtol=2**-8)
    assert (out == exact.bfloat16()).double().mean() > 0.95  # mostly the nearest bf16


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_bf16)])
def test_a_rows_bits_do_not_depend_on_its_company_or_the_thread_count(dtype):
    x = f32(32, 576, seed=1).to(dtype)
    packed = PackedStream.pack(f32(960, 576, seed=2).to(dtype))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([cpu_stream_linear(x[i : i + 1], packed) for i in range(32)])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(cpu_stream_linear(x, packed), alone)
    assert torch.equal(cpu_stream_linear(x[:20], packed), alone[:20])
    assert torch.equal(cpu_stream_linear(x[:7], packed), alone[:7])


@needs_kernels
def test_bad_inputs_raise():
    v = stream_width()
    w = f32(4 * v, 64, seed=1)
    with pytest.raises(ValueError, match=f"multiple of {v}"):
        PackedStream.pack(f32(4 * v + 1, 64, seed=1))
    with pytest.raises(ValueError, match="fp32"):
        PackedStream.pack(w.half())
    packed = PackedStream.pack(w)
    with pytest.raises(ValueError, match=f"1..{MAX_ROWS}"):
        cpu_stream_linear(f32(MAX_ROWS + 1, 64, seed=2), packed)
    with pytest.raises(ValueError, match=f"1..{MAX_ROWS}"):
        cpu_stream_linear(f32(4, 32, seed=2), packed)
    with pytest.raises(ValueError, match="bias"):
        cpu_stream_linear(f32(4, 64, seed=2), packed, f32(v, seed=3))
    with pytest.raises(ValueError, match="fp32"):
        cpu_stream_linear(f32(4, 64, seed=2).bfloat16(), packed)
    assert not stream_fits(f32(4 * v + 1, 64, seed=1)) and stream_fits(w)


@needs_bf16
def test_bf16_bad_inputs_raise():
    w = f32(64, 64, seed=1).bfloat16()
    for bad in (w[:40], w[:, :63].contiguous()):  # N not a multiple of 16, K odd
        assert not stream_fits(bad)
        with pytest.raises(ValueError, match="K even"):
            PackedStream.pack(bad)
    packed = PackedStream.pack(w)
    with pytest.raises(ValueError, match="bf16"):
        cpu_stream_linear(f32(4, 64, seed=2), packed)
    with pytest.raises(ValueError, match="bias"):
        cpu_stream_linear(f32(4, 64, seed=2).bfloat16(), packed, f32(64, seed=3))


@needs_stream
def test_stream_linears_take_decode_steps_and_leave_the_rest_to_onednn():
    fits, odd = f32(64, 64, seed=1), f32(300, 64, seed=2)
    linear = StreamLinears(Linears([fits, odd]), [fits, odd])
    assert set(linear.packed) == {fits.data_ptr()}
    small, large = f32(8, 64, seed=3), f32(MAX_ROWS + 1, 64, seed=4)
    packed = linear.packed[fits.data_ptr()]
    assert torch.equal(linear(small, fits), cpu_stream_linear(small, packed))
    assert torch.equal(linear(large, fits), linear.linears(large, fits))
    assert torch.equal(linear(small, odd), linear.linears(small, odd))


def tiny_fp32():
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, vocab_size=320)  # fmt: skip
    return LlamaForCausalLM(config).eval()


needs_bf16_runner = pytest.mark.skipif(
    not (cpu_kernels_available() and stream_pays(torch.bfloat16) and not amx_ready()),
    reason="needs an AVX-512 build with AVX512-BF16 on a CPU without AMX",
)
CLOSE = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 0.05, "rtol": 0.02}}


@pytest.mark.parametrize(
    "dtype",
    [pytest.param(torch.float32, marks=needs_stream), pytest.param(torch.bfloat16,
                                                                   marks=needs_bf16_runner)],
)  # fmt: skip
def test_a_kernels_runner_streams_decode_steps_to_rounding(dtype):
    """A step of 20 one-token sequences: the kernels config's runner (the stream) against
    the torch runner (oneDNN); the LM head (320 x 64) is streamed too."""
    hf = tiny_fp32().to(dtype)
    fused, plain = ModelRunner(hf, fused_ops=True), ModelRunner(hf)
    assert isinstance(fused.linear, StreamLinears) and isinstance(plain.linear, Linears)
    assert fused.linear.dtype == dtype and len(fused.linear.packed) == 1 + 4 * 2
    ids = torch.randint(0, 320, (20,))
    logits = []
    for runner in (fused, plain):
        pool = KVPool(runner.kv_spec, 20, runner.dtype, runner.device)
        meta = build_attention_metadata([0] * 20, [1] * 20, [[i] for i in range(20)], 1,
                                        runner.device)  # fmt: skip
        logits.append(runner.forward(ids, meta, pool))
    torch.testing.assert_close(logits[0], logits[1], **CLOSE[dtype])


@needs_kernels
def test_where_the_stream_is_used():
    """An fp32 runner of the kernels config where the build pays, and a bf16 one where it
    pays and the CPU has no AMX (the AMX linears run there), outside batch-invariant mode;
    its elementwise ops fused too."""
    hf = tiny_fp32()
    fused = ModelRunner(hf, fused_ops=True)
    assert isinstance(fused.linear, StreamLinears) == stream_pays() and fused.fused_ops
    assert not isinstance(ModelRunner(hf).linear, StreamLinears)
    assert not isinstance(ModelRunner(hf, fused_ops=True, batch_invariant=True).linear,
                          StreamLinears)  # fmt: skip
    bf16 = ModelRunner(tiny_fp32().bfloat16(), fused_ops=True).linear
    assert isinstance(bf16, StreamLinears) == (stream_pays(torch.bfloat16) and not amx_ready())
