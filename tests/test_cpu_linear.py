"""A decode step's bf16 linears on AMX tiles (kernels/cpu_linear.c) against fp32 torch, and
the runner that uses them.

Each output is a sum of exact bf16 x bf16 products in fp32, rounded to bf16 once, so it is
fp32 torch's product to within one bf16 step (2^-8 relative) plus fp32 summation order.
The shapes cross the kernel's tiles: 16 rows per tile (1, 15, 16, 17 and 32 rows), 32
columns per pair, 32 of K per step. The packing order is checked on any CPU; the kernel
runs only where the CPU has AMX-BF16.
"""

from __future__ import annotations

import pytest
import torch
from kvlab.kernels import cpu_kernels_available
from kvlab.kernels.cpu_linear import MAX_ROWS, PackedLinear, cpu_linear, linear_fits
from kvlab.kernels.cpu_prefill import amx_ready
from transformers import LlamaConfig, LlamaForCausalLM

from kvlab.cache.pool import KVPool
from kvlab.model.linear import AmxLinears, Linears
from kvlab.model.metadata import build_attention_metadata
from kvlab.model.runner import ModelRunner

needs_kernels = pytest.mark.skipif(not cpu_kernels_available(), reason="no native kernels")
needs_amx = pytest.mark.skipif(
    not (cpu_kernels_available() and amx_ready()), reason="needs a CPU with AMX-BF16"
)
ONE_STEP = dict(atol=1e-3, rtol=2**-8)


def bf16(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


@needs_kernels
def test_packing_puts_each_weight_where_the_tiles_read_it():
    """tile (pair jp, k step s, half h), row p, pair c = W[32 jp + 16 h + c][32 s + 2 p ..]."""
    n, k = 64, 96
    w = (torch.arange(n * k) % 251).view(n, k).bfloat16()  # integers below 256: exact
    tiles = PackedLinear.pack(w).tiles.view(n // 32, k // 32, 2, 16, 16, 2)
    expected = w.view(n // 32, 2, 16, k // 32, 16, 2).permute(0, 3, 1, 4, 2, 5)
    assert torch.equal(tiles, expected)


@needs_amx
@pytest.mark.parametrize("rows", [1, 15, 16, 17, 32])
@pytest.mark.parametrize("n, k, bias", [(960, 576, False), (576, 1536, True), (32, 32, True)])
def test_matches_fp32_torch(rows, n, k, bias):
    x, w = bf16(rows, k, seed=rows), bf16(n, k, seed=n + k)
    b = bf16(n, seed=7) if bias else None
    out = cpu_linear(x, PackedLinear.pack(w), b)
    expected = x.float() @ w.float().T + (b.float() if bias else 0)
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, **ONE_STEP)


@needs_amx
def test_a_rows_bits_do_not_depend_on_its_company_or_the_thread_count():
    x, packed = bf16(32, 576, seed=1), PackedLinear.pack(bf16(960, 576, seed=2))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([cpu_linear(x[i : i + 1], packed) for i in range(32)])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(cpu_linear(x, packed), alone)
    assert torch.equal(cpu_linear(x[:20], packed), alone[:20])


@needs_kernels
def test_bad_inputs_raise():
    w = bf16(64, 64, seed=1)
    with pytest.raises(ValueError, match="multiples of 32"):
        PackedLinear.pack(bf16(48, 64, seed=1))
    with pytest.raises(ValueError, match="bf16"):
        PackedLinear.pack(w.float())
    packed = PackedLinear.pack(w)
    with pytest.raises(ValueError, match=f"1..{MAX_ROWS}"):
        cpu_linear(bf16(MAX_ROWS + 1, 64, seed=2), packed)
    with pytest.raises(ValueError, match=f"1..{MAX_ROWS}"):
        cpu_linear(bf16(4, 32, seed=2), packed)
    with pytest.raises(ValueError, match="bias"):
        cpu_linear(bf16(4, 64, seed=2), packed, bf16(32, seed=3))
    assert not linear_fits(bf16(300, 64, seed=1)) and linear_fits(w)


@needs_amx
def test_amx_linears_take_decode_steps_and_leave_the_rest_to_onednn():
    fits, odd = bf16(64, 64, seed=1), bf16(300, 64, seed=2)
    linear = AmxLinears(Linears([fits, odd]), [fits, odd])
    assert set(linear.packed) == {fits.data_ptr()}
    small, large = bf16(8, 64, seed=3), bf16(MAX_ROWS + 1, 64, seed=4)
    assert torch.equal(linear(small, fits), cpu_linear(small, linear.packed[fits.data_ptr()]))
    assert torch.equal(linear(large, fits), linear.linears(large, fits))
    assert torch.equal(linear(small, odd), linear.linears(small, odd))


@needs_amx
def test_a_fused_runner_decodes_on_amx_to_rounding():
    """A bf16 step of 20 one-token sequences: the fused runner (AMX linears) against the
    torch runner (oneDNN); the LM head (320 x 64) is on AMX too."""
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, vocab_size=320)  # fmt: skip
    hf = LlamaForCausalLM(config).bfloat16().eval()
    fused, plain = ModelRunner(hf, fused_ops=True), ModelRunner(hf)
    assert isinstance(fused.linear, AmxLinears) and isinstance(plain.linear, Linears)
    ids = torch.randint(0, 320, (20,))
    logits = []
    for runner in (fused, plain):
        pool = KVPool(runner.kv_spec, 20, runner.dtype, runner.device)
        meta = build_attention_metadata([0] * 20, [1] * 20, [[i] for i in range(20)], 1,
                                        runner.device)  # fmt: skip
        logits.append(runner.forward(ids, meta, pool))
    torch.testing.assert_close(logits[0], logits[1], atol=0.05, rtol=0.02)
