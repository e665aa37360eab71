"""A decoder layer's decode step in two native calls (kernels/cpu_layer.c) against the
per-op fused path it replaces: the same entry points in the same order, so the same bits,
in the logits and in every K/V the pool stores. bf16 runs where the CPU has AMX-BF16 (the
AMX linears) or the build AVX512-BF16 (the stream), fp32 where the library is built for
AVX-512 (the stream linear's `stream_pays`)."""

from __future__ import annotations

import pytest
import torch
from kvlab.kernels import cpu_kernels_available
from kvlab.kernels.cpu_layer import LayerKernels, PackedLayer, matmul_seconds
from kvlab.kernels.cpu_linear import MAX_ROWS, PackedLinear
from kvlab.kernels.cpu_prefill import amx_ready
from kvlab.kernels.cpu_stream import PackedStream, stream_pays
from transformers import LlamaConfig, LlamaForCausalLM

from kvlab.cache.pool import KVPool
from kvlab.model.metadata import build_attention_metadata
from kvlab.model.runner import ModelRunner

needs_amx = pytest.mark.skipif(
    not (cpu_kernels_available() and amx_ready()), reason="needs a CPU with AMX-BF16"
)
needs_stream = pytest.mark.skipif(
    not (cpu_kernels_available() and stream_pays()), reason="needs a build with FMA vectors"
)
needs_bf16 = pytest.mark.skipif(
    not (cpu_kernels_available() and (amx_ready() or stream_pays(torch.bfloat16))),
    reason="needs a CPU with AMX-BF16 or a build with AVX512-BF16",
)
needs_bf16_stream = pytest.mark.skipif(
    not (cpu_kernels_available() and stream_pays(torch.bfloat16)),
    reason="needs an AVX-512 build with AVX512-BF16",
)
pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="no native kernels")
DTYPES = [
    pytest.param(torch.bfloat16, marks=needs_bf16),
    pytest.param(torch.float32, marks=needs_stream),
]
VOCAB = 320


def tiny_bf16(bias: bool, vocab: int = VOCAB, dtype=torch.bfloat16) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, vocab_size=vocab,
                         attention_bias=bias)  # fmt: skip
    hf = LlamaForCausalLM(config).to(dtype).eval()
    if bias:  # random, so a wrong bias shows
        for layer in hf.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.data.normal_()
    return hf


def run(runner: ModelRunner, prompts: list[int], decodes: int):
    """A prompt step of `prompts` lengths, then `decodes` one-token steps: each step's
    logits, and the pool."""
    pool = KVPool(runner.kv_spec, 64 * len(prompts), runner.dtype, runner.device)
    gen = torch.Generator().manual_seed(1)
    starts = [64 * i for i in range(len(prompts))]
    tables = [list(range(s, s + 64)) for s in starts]
    logits, cached = [], [0] * len(prompts)
    for step in range(decodes + 1):
        new = prompts if step == 0 else [1] * len(prompts)
        ids = torch.randint(0, VOCAB, (sum(new),), generator=gen)
        meta = build_attention_metadata(cached, new, tables, 1, runner.device)
        logits.append(runner.forward(ids, meta, pool))
        cached = [c + n for c, n in zip(cached, new)]
    return logits, pool


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("prompts", [[3, 5, 2], [1] * MAX_ROWS])
def test_the_layer_calls_give_the_per_op_paths_bits(bias, prompts, dtype):
    hf = tiny_bf16(bias, dtype=dtype)
    fast, per_op = ModelRunner(hf, fused_ops=True), ModelRunner(hf, fused_ops=True)
    per_op.layer_kernels = None
    assert isinstance(fast.layer_kernels, LayerKernels)
    before = matmul_seconds()
    (got, got_pool), (want, want_pool) = run(fast, prompts, 3), run(per_op, prompts, 3)
    assert matmul_seconds() > before  # the calls count their matmuls' time
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    written = torch.tensor([64 * i + j for i, n in enumerate(prompts) for j in range(n + 3)])
    for a, b in zip(got_pool.codec.stored, want_pool.codec.stored):
        assert torch.equal(a[:, written], b[:, written])


@needs_bf16
def test_steps_past_the_kernels_rows_take_the_per_op_path():
    fast = ModelRunner(tiny_bf16(False), fused_ops=True)
    h = torch.zeros(MAX_ROWS + 1, 64, dtype=torch.bfloat16)
    assert not fast.layer_kernels.takes(h) and fast.layer_kernels.takes(h[:MAX_ROWS])
    assert not fast.layer_kernels.takes(h[:4].float())
    with pytest.raises(ValueError, match=r"attn must be \(4, 64\) torch.bfloat16"):
        fast.layer_kernels.mlp(0, h[:4], torch.zeros(4, 64))


@pytest.mark.parametrize("dtype", DTYPES)
def test_only_a_fused_runner_has_them(dtype):
    hf = tiny_bf16(False, dtype=dtype)
    assert ModelRunner(hf).layer_kernels is None
    assert ModelRunner(hf, fused_ops=True, batch_invariant=True).layer_kernels is None
    kernels = ModelRunner(hf, fused_ops=True).layer_kernels
    assert kernels is not None and kernels.dtype == dtype


@needs_amx
def test_shapes_that_do_not_match_the_heads_are_refused():
    w = lambda n, k: PackedLinear.pack(torch.randn(n, k).bfloat16())  # noqa: E731
    norm = torch.ones(64, dtype=torch.bfloat16)
    layer = PackedLayer(norm, w(128, 64), None, w(64, 64), norm, w(256, 64), w(64, 128))
    LayerKernels([layer], heads=2, kv_heads=1, head_dim=32, eps=1e-5)
    with pytest.raises(ValueError, match="do not fit 2 heads, 2 KV heads"):
        LayerKernels([layer], heads=2, kv_heads=2, head_dim=32, eps=1e-5)
    with pytest.raises(ValueError, match="norms must be"):
        LayerKernels([PackedLayer(norm[:32], *[*vars(layer).values()][1:])], 2, 1, 32, 1e-5)
    fp32 = PackedLayer(norm.float(), *[*vars(layer).values()][1:4], norm.float(),
                       *[*vars(layer).values()][5:])  # fmt: skip
    with pytest.raises(ValueError, match="matmuls must be torch.float32"):
        LayerKernels([fp32], heads=2, kv_heads=1, head_dim=32, eps=1e-5)


@needs_bf16_stream
def test_a_layers_matmuls_share_one_kernel_and_dtype():
    """bf16 panels take the stream (`stream` 1); a layer mixing dtypes, or (where the CPU
    has AMX) the AMX linear's tiles with the stream's panels, is refused."""
    panels = lambda n, k, dtype=torch.bfloat16: PackedStream.pack(torch.randn(n, k).to(dtype))  # noqa: E731
    norm = torch.ones(64, dtype=torch.bfloat16)
    layer = PackedLayer(norm, panels(128, 64), None, panels(64, 64), norm, panels(256, 64),
                        panels(64, 128))  # fmt: skip
    assert LayerKernels([layer], heads=2, kv_heads=1, head_dim=32, eps=1e-5).stream == 1
    mixed = [*vars(layer).values()]
    mixed[3] = panels(64, 64, torch.float32)
    with pytest.raises(ValueError, match="matmuls must be torch.bfloat16"):
        LayerKernels([PackedLayer(*mixed)], heads=2, kv_heads=1, head_dim=32, eps=1e-5)
    if amx_ready():
        mixed[3] = PackedLinear.pack(torch.randn(64, 64).bfloat16())
        with pytest.raises(ValueError, match="all packed as PackedStream"):
            LayerKernels([PackedLayer(*mixed)], heads=2, kv_heads=1, head_dim=32, eps=1e-5)


@needs_bf16
def test_the_step_profile_counts_the_layer_calls_matmuls(model):
    from kvlab import EngineConfig
    from kvlab.experiments.step_profile import profile_steps
    from kvlab.model.loading import LoadedModel
    from kvlab.workloads import Request

    hf = tiny_bf16(False, vocab=len(model.tokenizer))
    tiny = LoadedModel(hf, model.tokenizer, name="tiny-bf16", load_seconds=0.0)
    config = EngineConfig(cache="paged", attention="kernels", kv_budget_tokens=16 * 40,
                          max_model_len=256)  # fmt: skip
    requests = [Request(prompt=[1 + (i * 7 + j) % 300 for j in range(9 + i)], max_new_tokens=4)
                for i in range(3)]  # fmt: skip
    before = matmul_seconds()
    steps = profile_steps(tiny, requests, config)
    counted = matmul_seconds() - before
    assert counted > 0 and (steps.phase == "decode").sum() == 3
    # the steps' matmuls: what the layer calls counted, and the LM head's
    assert steps["matmuls ms"].sum() / 1e3 >= counted
