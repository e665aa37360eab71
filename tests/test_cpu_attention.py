"""KernelAttention's CPU path (kvlab.model.cpu_attention) equals the torch reference.

Every kind of group on one paged pool with scrambled blocks, NaN in every slot no context
owns: decodes (the decode kernel), a whole prompt, a prompt behind a short cached prefix
and one behind a long prefix (the prompt kernel), all in one mixed step; the same with a
retention policy's dropped blocks; a head size off the prompt kernel's vectors (the
reference's call); and the real model's greedy tokens. The group tests run with prompts
through the prompt kernel and through the reference both, whichever this CPU's dispatch
picks (prompt_pays).
"""

from __future__ import annotations

import kvlab.kernels.cpu_prefill as cpu_prefill
import pytest
import torch
from kvlab.kernels import cpu_kernels_available

import kvlab
from kvlab.cache.pool import KVPool
from kvlab.cache.retention.base import DROPPED
from kvlab.cache.spec import KVSpec
from kvlab.model.attention import pooled_attention
from kvlab.model.cpu_attention import cpu_attention
from kvlab.model.metadata import build_attention_metadata

pytestmark = pytest.mark.skipif(
    not cpu_kernels_available(), reason="the native CPU kernel did not build (no C compiler?)"
)
BLOCK = 4
# (cached tokens, new tokens, block table): decodes, a whole prompt, a prompt behind a
# short prefix (Q > P), one behind a long prefix (Q < P).
STEP = [
    (10, 1, [5, 2, 7]),
    (3, 1, [1]),
    (0, 7, [11, 0]),
    (4, 9, [9, 3, 12, 4]),
    (12, 3, [6, 13, 8, 10]),
]


@pytest.fixture(params=[True, False], ids=["prompt-kernel", "prompt-reference"])
def prompt_kernel(request, monkeypatch):
    """Both dispatches of a prompt group, on any CPU."""
    monkeypatch.setattr(cpu_prefill, "prompt_pays", lambda q, k_cache: request.param)
    return request.param


def _pool(dtype: torch.dtype, codec=None, dim=16) -> tuple[KVPool, torch.Generator]:
    g = torch.Generator().manual_seed(3)
    pool = KVPool(KVSpec(1, 2, dim), 16 * BLOCK, dtype, torch.device("cpu"), codec)
    every = torch.arange(pool.num_slots)
    k, v = (torch.randn(pool.num_slots, 2, dim, generator=g).to(dtype) for _ in range(2))
    pool.write(0, every, k, v)
    return pool, g


def _check(step, dtype, tol, codec=None, dim=16):
    pool, g = _pool(dtype, codec, dim)
    meta = build_attention_metadata(
        [s for s, _, _ in step], [n for _, n, _ in step], [t for *_, t in step], BLOCK, "cpu"
    )
    used = meta.context_slots.unique()
    unused = torch.ones(pool.num_slots, dtype=torch.bool)
    unused[used] = False
    pool.poison(unused.nonzero()[:, 0])  # NaN wherever no context reads
    q = torch.randn(int(meta.positions.shape[0]), 6, dim, generator=g).to(dtype)
    expected = pooled_attention(q, 0, pool, meta, 0.25)
    got = cpu_attention(q, 0, pool, meta, 0.25)
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), expected.float(), **tol)


@pytest.mark.parametrize(
    "dtype, codec, tol",
    [
        (torch.float32, None, dict(atol=2e-5, rtol=2e-5)),
        (torch.bfloat16, None, dict(atol=2e-2, rtol=2e-2)),
        (torch.float32, "bf16", dict(atol=2e-2, rtol=2e-2)),
    ],
)
def test_every_group_kind_in_one_mixed_step(dtype, codec, tol, prompt_kernel):
    _check(STEP, dtype, tol, codec)


def test_dropped_blocks_of_a_retention_policy(prompt_kernel):
    step = [(12, 1, [5, DROPPED, 7, 2]), (8, 6, [9, DROPPED, 3, 12])]
    _check(step, torch.float32, dict(atol=2e-5, rtol=2e-5))


def test_head_size_off_the_prompt_kernels_vectors():
    _check(STEP, torch.float32, dict(atol=2e-5, rtol=2e-5), dim=12)


def test_real_model_greedy_tokens_equal_the_torch_path(model):
    """Prefix hits (a shared system prompt), chunked prefill and decodes, mixed in steps:
    the kernels config gives the torch path's greedy tokens."""
    prompts = kvlab.texts.chat_prompts()[:6]
    params = kvlab.SamplingParams(max_new_tokens=12, ignore_eos=True)
    outputs = {}
    for attention in ("torch", "kernels"):
        config = kvlab.EngineConfig(
            cache="paged",
            prefix_caching="hash",
            chunked_prefill=True,
            max_num_batched_tokens=48,
            attention=attention,
        )
        engine = kvlab.Engine(model, config)
        outputs[attention] = [o.token_ids for o in engine.generate(prompts, params)]
    assert outputs["kernels"] == outputs["torch"]
