"""A layer's fused elementwise kernels (kernels/cpu_fused.c) against the runner's torch
ops, and the runner that uses them.

In bf16 the residual add and RoPE round exactly where torch's bf16 ops do, so they must
give torch's bits; the norm (its sum of squares in another order) may differ by one bf16
step, SwiGLU (the kernels' e^x and reciprocal in silu(gate), then the product) by two. In
fp32 the add is torch's bits and the rest within a few ulp. Rows are long enough to cross
the kernels' vectors many times, and enough of them to split over threads.
"""

from __future__ import annotations

import pytest
import torch
from kvlab.kernels import cpu_kernels_available
from kvlab.kernels.cpu_build import cpu_kernels_error
from kvlab.kernels.cpu_fused import cpu_add_rms_norm, cpu_rope, cpu_silu_mul
from transformers import LlamaConfig, LlamaForCausalLM

from kvlab.cache.pool import KVPool
from kvlab.model.metadata import build_attention_metadata
from kvlab.model.runner import ModelRunner, apply_rope, rms_norm, silu_mul

ONE_STEP = dict(atol=1e-6, rtol=2**-7)  # one bf16 step (8 bits of mantissa)
TWO_STEPS = dict(atol=1e-6, rtol=2**-6)  # SwiGLU: one in silu(gate), carried by the product
FEW_ULP = dict(atol=1e-6, rtol=1e-6)  # fp32: a few ulp (2^-23 each)


@pytest.fixture(autouse=True)
def _needs_kernels():
    if not cpu_kernels_available():
        pytest.skip(f"the native CPU kernels are unavailable: {cpu_kernels_error()}")


def bf16(*shape, seed, scale=3.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16()


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_add_and_norm(rows):
    h, delta, weight = bf16(rows, 576, seed=1), bf16(rows, 576, seed=2), bf16(576, seed=3)
    expected_h = h + delta
    out = cpu_add_rms_norm(h, delta, weight, 1e-5)
    assert torch.equal(h, expected_h)  # the residual add: torch's bits, in place
    torch.testing.assert_close(out.float(), rms_norm(h, weight, 1e-5).float(), **ONE_STEP)
    before = h.clone()
    cpu_add_rms_norm(h, None, weight, 1e-5)  # no delta: h stays
    assert torch.equal(h, before)


@pytest.mark.parametrize("rows", [1, 40, 300])
def test_swiglu(rows):
    gate, up = bf16(rows, 2 * 1536, seed=4).chunk(2, dim=-1)  # views of one output
    out = cpu_silu_mul(gate, up)
    torch.testing.assert_close(out.float(), silu_mul(gate.clone(), up).float(), **TWO_STEPS)


@pytest.mark.parametrize("rows", [1, 33, 300])
def test_rope_gives_torch_bits_on_views_of_a_fused_qkv(rows):
    qkv = bf16(rows, (9 + 3 + 3) * 64, seed=5)
    q, k = qkv[:, :576].view(rows, 9, 64), qkv[:, 576:768].view(rows, 3, 64)
    angles = torch.arange(rows).float()[:, None] * 10000 ** (-torch.arange(0, 64, 2) / 64)
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    for x in (q, k):
        out = cpu_rope(x, cos, sin)
        assert out.is_contiguous() and torch.equal(out, apply_rope(x, cos, sin))


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_fp32_ops_within_a_few_ulp_of_torch(rows):
    h, delta, weight = (bf16(rows, 576, seed=1).float(), bf16(rows, 576, seed=2).float(),
                        bf16(576, seed=3).float())  # fmt: skip
    expected_h = h + delta
    out = cpu_add_rms_norm(h, delta, weight, 1e-5)
    assert out.dtype == torch.float32 and torch.equal(h, expected_h)
    torch.testing.assert_close(out, rms_norm(h, weight, 1e-5), **FEW_ULP)
    gate, up = bf16(rows, 2 * 1536, seed=4).float().chunk(2, dim=-1)
    torch.testing.assert_close(cpu_silu_mul(gate, up), silu_mul(gate.clone(), up), **FEW_ULP)
    qkv = bf16(rows, 15 * 64, seed=5).float()
    q = qkv[:, :576].view(rows, 9, 64)
    angles = torch.arange(rows).float()[:, None] * 10000 ** (-torch.arange(0, 64, 2) / 64)
    cos, sin = torch.cat((angles, angles), dim=-1).cos(), torch.cat((angles, angles), -1).sin()
    torch.testing.assert_close(cpu_rope(q, cos, sin), apply_rope(q, cos, sin), **FEW_ULP)


def test_same_bits_for_any_thread_count():
    h, delta, weight = bf16(500, 576, seed=6), bf16(500, 576, seed=7), bf16(576, seed=8)
    gate, up = bf16(500, 1536, seed=9), bf16(500, 1536, seed=10)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, max(2, threads)):
            torch.set_num_threads(n)
            results.append(
                (cpu_add_rms_norm(h.clone(), delta, weight, 1e-5), cpu_silu_mul(gate, up))
            )
    finally:
        torch.set_num_threads(threads)
    for one, many in zip(*results):
        assert torch.equal(one, many)


def test_bad_inputs_raise():
    h, weight = bf16(4, 576, seed=1), bf16(576, seed=2)
    with pytest.raises(ValueError, match="bf16 or fp32"):
        cpu_add_rms_norm(h.half(), None, weight, 1e-5)
    with pytest.raises(ValueError, match="weight"):
        cpu_add_rms_norm(h.float(), None, weight, 1e-5)
    with pytest.raises(ValueError, match="one dtype"):
        cpu_silu_mul(h, h.float())
    with pytest.raises(ValueError, match="multiple of 16"):
        cpu_silu_mul(h[:, :40], h[:, 40:80])
    with pytest.raises(ValueError, match="weight"):
        cpu_add_rms_norm(h, None, weight[:100], 1e-5)
    with pytest.raises(ValueError, match="head_dim must be a multiple of 32"):
        cpu_rope(h.view(4, 12, 48), h[:, :48], h[:, :48])


def _logits(runner, ids):
    pool = KVPool(runner.kv_spec, len(ids), runner.dtype, runner.device)
    meta = build_attention_metadata([0], [len(ids)], [[0]], len(ids), runner.device)
    return runner.forward(torch.tensor(ids), meta, pool, all_logits=True)


def test_a_fused_runner_equals_the_torch_runner_to_rounding():
    """A 2-layer bf16 Llama whose sizes fit the kernels (head_dim 32): the fused runner's
    logits are the torch runner's to within bf16 rounding carried through two layers; in
    fp32 to a few ulp."""
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, vocab_size=300)  # fmt: skip
    hf32 = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 300, (50,)).tolist()
    fused32 = ModelRunner(hf32, fused_ops=True)
    assert fused32.fused_ops
    torch.testing.assert_close(_logits(fused32, ids), _logits(ModelRunner(hf32), ids),
                               atol=1e-5, rtol=1e-5)  # fmt: skip
    hf = LlamaForCausalLM(config).bfloat16().eval()
    fused, plain = ModelRunner(hf, fused_ops=True), ModelRunner(hf)
    assert fused.fused_ops and not plain.fused_ops
    ours, theirs = _logits(fused, ids), _logits(plain, ids)
    torch.testing.assert_close(ours, theirs, atol=0.05, rtol=0.02)
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() >= 0.95
