"""kvlab.kernels: each Triton kernel against its torch reference, and the references against
kvlab's own torch path (KVPool codecs, pooled_attention).

On CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set below before
triton is first imported), on small shapes. With CUDA, the same checks also run at full
size on the GPU (test_gpu_*; skipped without CUDA).

Tolerances (kernel vs reference): fp32 1e-5 absolute and relative. Quantized codecs get
the same: the reference dequantizes the very codes the kernel reads, so only the order of
the sums differs. KV writes are compared bit for bit. On the GPU, bf16 gets 2e-2 (the
kernel rounds probabilities to bf16 for the P @ V product, as flash attention does) and
fp32 1e-4 (exp2 is approximate there), both relative to the output's largest value.
"""

from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available():
    # Triton picks compiled vs interpreted when it is imported: this must come first.
    assert "triton" not in sys.modules or os.environ.get("TRITON_INTERPRET") == "1", (
        "triton was imported before tests/test_kernels.py could set TRITON_INTERPRET=1"
    )
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from kvlab.kernels import (  # noqa: E402
    choose_backend,
    cpu_kernels_available,
    kv_write,
    kv_write_ref,
    kv_write_triton,
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_decode_attention_triton,
    walk,
)
from kvlab.kernels.bench import storage_dtype  # noqa: E402

import kvlab  # noqa: E402
from kvlab.cache.pool import KVPool  # noqa: E402
from kvlab.cache.spec import KVSpec
from kvlab.model.attention import pooled_attention  # noqa: E402
from kvlab.model.kernel_args import pool_layer  # noqa: E402
from kvlab.model.kernel_attention import KernelAttention, kernel_write  # noqa: E402
from kvlab.model.metadata import build_attention_metadata  # noqa: E402
from kvlab.units import ceil_div  # noqa: E402

BACKENDS = ("torch", "triton") + (("cpu",) if cpu_kernels_available() else ())

CODECS = (None, "int8", "fp8_e4m3", "fp8_e5m2")
FLOAT_CODECS = (None, "fp16", "bf16")
TOL = dict(atol=1e-5, rtol=1e-5)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def kv_values(g: torch.Generator, *shape: int, device="cpu") -> torch.Tensor:
    """Gaussian K/V with a different magnitude per token and head (scales vary)."""
    x = torch.randn(*shape, generator=g)
    magnitude = torch.exp(2 * torch.randn(*shape[:-1], 1, generator=g))
    return (x * magnitude).to(device)


class Case:
    """A paged pool with random block tables; every slot outside the contexts is NaN."""

    def __init__(
        self,
        lens: list[int],
        block_size: int,
        heads: int,
        kv_heads: int,
        dim: int,
        kv_codec: str | None,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        seed: int = 0,
    ):
        g = torch.Generator().manual_seed(seed)
        need = [ceil_div(n, block_size) for n in lens]
        num_blocks = sum(need) + 3  # a few blocks nobody owns
        order = torch.randperm(num_blocks, generator=g).tolist()
        tables = torch.zeros(len(lens), max(need), dtype=torch.int32)  # padded with 0
        used = []
        for b, n in enumerate(need):
            blocks, order = order[:n], order[n:]
            tables[b, :n] = torch.tensor(blocks, dtype=torch.int32)
            used += [blocks[p // block_size] * block_size + p % block_size for p in range(lens[b])]
        slots = num_blocks * block_size
        self.kv_codec, self.block_size = kv_codec, block_size
        self.scale = dim**-0.5
        self.q = torch.randn(len(lens), heads, dim, generator=g).to(device, dtype)
        self.tables = tables.to(device)
        self.lens = torch.tensor(lens, dtype=torch.int32, device=device)
        store = storage_dtype(kv_codec, dtype)
        self.k_cache = torch.zeros(slots, kv_heads, dim, dtype=store, device=device)
        self.v_cache = torch.zeros_like(self.k_cache)
        self.k_scale = torch.zeros(slots, kv_heads, dtype=torch.bfloat16, device=device)
        self.v_scale = torch.zeros_like(self.k_scale)
        k, v = (kv_values(g, slots, kv_heads, dim, device=device).to(dtype) for _ in range(2))
        all_slots = torch.arange(slots, device=device)
        kv_write_ref(k, v, self.k_cache, self.v_cache, all_slots, *self.scales, kv_codec)
        unused = torch.ones(slots, dtype=torch.bool)
        unused[used] = False
        unused = unused.to(device)
        for cache, scale in ((self.k_cache, self.k_scale), (self.v_cache, self.v_scale)):
            if cache.is_floating_point():
                cache[unused] = float("nan")  # a read outside the contexts shows up as NaN
            else:
                scale[unused] = float("nan")

    @property
    def scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_scale, self.v_scale

    def args(self) -> tuple:
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            self.tables,
            self.lens,
            self.scale,
            self.block_size,
            *self.scales,
            self.kv_codec,
        )


# (context lens, block_size, heads, kv_heads, head_dim, num_splits): ragged contexts, a
# partly filled last block (block size > 1), GQA ratios 1, 2, 3, 8, non-power-of-2 sizes.
SMALL_CASES = [
    ([3, 9], 1, 4, 4, 16, 1),
    ([5, 13, 8], 4, 4, 2, 16, 2),
    ([17, 40], 16, 6, 2, 32, 1),
    ([11, 23, 1], 5, 8, 1, 16, 3),
    ([20], 8, 4, 2, 24, 2),
]


@pytest.mark.parametrize("kv_codec", CODECS)
@pytest.mark.parametrize("case", SMALL_CASES, ids=lambda c: f"bs{c[1]}-h{c[2]}/{c[3]}-d{c[4]}")
def test_decode_attention_kernel_matches_reference(case, kv_codec):
    lens, block_size, heads, kv_heads, dim, splits = case
    c = Case(lens, block_size, heads, kv_heads, dim, kv_codec)
    ref = paged_decode_attention_ref(*c.args())
    assert torch.isfinite(ref).all()  # the reference never read a poisoned slot
    out = paged_decode_attention_triton(*c.args(), splits, tile=16)
    torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.parametrize("kv_codec", ["fp16", "bf16"])
def test_decode_attention_over_narrow_float_storage(kv_codec):
    c = Case([7, 30], 4, 4, 2, 16, kv_codec)
    ref = paged_decode_attention_ref(*c.args())
    out = paged_decode_attention_triton(*c.args(), 2, tile=16)
    torch.testing.assert_close(out, ref, **TOL)


def test_split_k_changes_nothing():
    c = Case([45, 64, 2], 8, 4, 2, 16, "int8", seed=3)
    outs = [paged_decode_attention_triton(*c.args(), n, tile=16) for n in (1, 2, 5)]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], **TOL)


def special_kv(g: torch.Generator, tokens: int, kv_heads: int, dim: int) -> torch.Tensor:
    """K or V with the cases quantizers get wrong: an all-zero head, exact rounding ties,
    values 1e-9 of the head's max (fp8 subnormals, flushes), negative zeros."""
    x = kv_values(g, tokens, kv_heads, dim)
    x[0, 0] = 0.0
    s0 = 2.0**-4  # a bf16-exact scale: x / s lands exactly on k + 0.5
    ties = (torch.arange(dim) % 120 - 60 + 0.5) * s0
    x[1, 0] = torch.cat([torch.tensor([127 * s0]), ties[1:]])
    x[2, 0] = torch.logspace(-9, 3, dim) * torch.where(torch.arange(dim) % 2 == 0, 1.0, -1.0)
    x[3, 0, : dim // 2] = -0.0
    return x


@pytest.mark.parametrize("kv_codec", FLOAT_CODECS + CODECS[1:])
def test_kv_write_kernel_is_bitwise_the_codec(kv_codec):
    """kernel == reference == KVPool's codec, byte for byte, codes and scales."""
    tokens, kv_heads, dim, slots = 9, 2, 32, 24
    g = torch.Generator().manual_seed(1)
    k, v = special_kv(g, tokens, kv_heads, dim), special_kv(g, tokens, kv_heads, dim)
    slot_mapping = torch.randperm(slots, generator=g)[:tokens]
    pool = KVPool(KVSpec(1, kv_heads, dim), slots, torch.float32, torch.device("cpu"), kv_codec)
    pool.write(0, slot_mapping, k, v)
    expected = pool_layer(pool, 0)
    for write in (kv_write_ref, kv_write_triton):
        store = storage_dtype(kv_codec, torch.float32)
        got = {
            "k_cache": torch.zeros(slots, kv_heads, dim, dtype=store),
            "v_cache": torch.zeros(slots, kv_heads, dim, dtype=store),
        }
        if kv_codec in CODECS[1:]:
            got.update(
                {
                    n: torch.zeros(slots, kv_heads, dtype=torch.bfloat16)
                    for n in ("k_scale", "v_scale")
                }
            )
        write(k, v, slot_mapping=slot_mapping, kv_codec=kv_codec, **got)
        for name, tensor in got.items():
            want = expected[name][slot_mapping]
            assert torch.equal(tensor[slot_mapping].view(torch.uint8), want.view(torch.uint8)), (
                f"{write.__name__}: {name} differs from the codec's"
            )


def test_reference_equals_pooled_attention_on_a_paged_pool():
    """The kernels' reference == kvlab.model.attention.pooled_attention, same pool, same step."""
    spec, block_size = KVSpec(1, 2, 16), 4
    g = torch.Generator().manual_seed(2)
    tables = [[5, 2, 7], [1, 6], [3, 0, 4, 8]]  # physical blocks, deliberately scrambled
    lens = [11, 5, 14]  # context lengths after this decode step; last blocks partly full
    meta = build_attention_metadata(
        [n - 1 for n in lens], [1] * 3, tables, block_size, torch.device("cpu")
    )
    for kv_codec in CODECS:
        pool = KVPool(spec, 9 * block_size, torch.float32, torch.device("cpu"), kv_codec)
        every = torch.arange(pool.num_slots)
        pool.write(0, every, *(kv_values(g, pool.num_slots, 2, 16) for _ in range(2)))
        q = torch.randn(3, 4, 16, generator=g)
        expected = pooled_attention(q, 0, pool, meta, 0.25)
        table = torch.zeros(3, 4, dtype=torch.int32)
        for b, t in enumerate(tables):
            table[b, : len(t)] = torch.tensor(t)
        lens_t = torch.tensor(lens, dtype=torch.int32)
        ref = paged_decode_attention_ref(
            q,
            **pool_layer(pool, 0),
            block_tables=table,
            context_lens=lens_t,
            scale=0.25,
            block_size=block_size,
        )
        torch.testing.assert_close(ref, expected, **TOL)
        # The adapter reads the same block tables (the native CPU kernel: the slots) off
        # the metadata.
        for backend in BACKENDS:
            attn = KernelAttention(block_size, backend=backend)
            torch.testing.assert_close(attn(q, 0, pool, meta, 0.25), expected, **TOL)
            assert attn.decode_calls == 1


def test_adapter_leaves_prefill_and_other_codecs_to_torch():
    spec = KVSpec(1, 2, 16)
    meta = build_attention_metadata([0], [6], [[1, 0]], 4, torch.device("cpu"))  # prefill
    pool = KVPool(spec, 16, torch.float32, torch.device("cpu"))
    pool.write(0, meta.slot_mapping, torch.randn(6, 2, 16), torch.randn(6, 2, 16))
    q = torch.randn(6, 4, 16)
    attn = KernelAttention(4, backend="triton")
    torch.testing.assert_close(
        attn(q, 0, pool, meta, 0.25), pooled_attention(q, 0, pool, meta, 0.25)
    )
    int4 = KVPool(spec, 16, torch.float32, torch.device("cpu"), "int4")
    decode = build_attention_metadata([5], [1], [[1, 0]], 4, torch.device("cpu"))
    assert not attn.handles(int4, decode) and attn.handles(pool, decode)
    assert attn.decode_calls == 0


@pytest.mark.parametrize("backend", BACKENDS[1:])
@pytest.mark.parametrize("kv_codec", [None, "int8"])
def test_engine_decodes_the_same_tokens_through_the_kernels(tiny_model, kv_codec, backend):
    """A tiny random Llama: the engine's greedy tokens with Triton decode (interpreted)
    or the native CPU kernel are the torch path's."""
    prompts = [[1, 520, 9531, 198, 4093], [1, 2683, 359, 253, 5356, 5646, 11173]]
    params = kvlab.SamplingParams(max_new_tokens=5, ignore_eos=True)
    outputs = {}
    for path in ("torch", "kernels"):
        engine = kvlab.Engine(
            tiny_model,
            kvlab.EngineConfig(cache="paged", block_size=4, kv_budget_tokens=64, kv_codec=kv_codec),
        )
        if path == "kernels":
            attn = KernelAttention(engine.cache.block_size, backend=backend)
            engine.runner.use_attention(attn)
        outputs[path] = [o.token_ids for o in engine.generate(prompts, params)]
    assert attn.decode_calls == 4 * 2  # 4 decode steps x 2 layers
    assert outputs["kernels"] == outputs["torch"]


def test_kernel_write_goes_through_the_pool_layout():
    spec = KVSpec(2, 2, 16)
    k, v = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    slots = torch.tensor([4, 0, 9])
    for kv_codec in ("int8", "int4"):  # int4: the codec's own write
        a = KVPool(spec, 12, torch.float32, torch.device("cpu"), kv_codec)
        b = KVPool(spec, 12, torch.float32, torch.device("cpu"), kv_codec)
        a.write(1, slots, k, v)
        kernel_write(b, 1, slots, k, v, backend="triton")
        torch.testing.assert_close(b.gather(1, slots[None]), a.gather(1, slots[None]), **TOL)


def test_dispatch(monkeypatch):
    monkeypatch.delenv("KVLAB_KERNELS", raising=False)
    assert choose_backend("cpu") == ("cpu" if cpu_kernels_available() else "torch")
    assert choose_backend("cuda") == "triton"
    assert choose_backend("cpu", "triton") == "triton"
    monkeypatch.setenv("KVLAB_KERNELS", "torch")
    assert choose_backend("cuda") == "torch"
    monkeypatch.setenv("KVLAB_KERNELS", "cuda")
    with pytest.raises(ValueError, match="KVLAB_KERNELS"):
        choose_backend("cpu")
    monkeypatch.setenv("KVLAB_KERNELS", "triton")  # the dispatching entry points obey it
    c = Case([6, 3], 2, 4, 2, 16, "fp8_e5m2")
    torch.testing.assert_close(
        paged_decode_attention(*c.args()), paged_decode_attention_ref(*c.args()), **TOL
    )
    with pytest.raises(ValueError, match="int4"):
        kv_write(c.q, c.q, c.k_cache, c.v_cache, c.lens, kv_codec="int4")


def test_walk_is_the_kernels_addressing():
    rows = walk([[5, 2, 7], [1, 6]], [10, 6], block_size=4, tile=4, num_splits=2)
    assert [r["slot"] for r in rows if r["seq"] == 0] == [20, 21, 22, 23, 8, 9, 10, 11, 28, 29]
    assert {r["split"] for r in rows if r["seq"] == 1} == {0}  # its 6 tokens fit one chunk
    assert [r["tile"] for r in rows if r["seq"] == 0][4:8] == [1, 1, 1, 1]


# --- the same checks at full size, on a GPU ------------------------------------------------
GPU_CASES = [([4096] * 32, 16, 32, 8, 128), ([17, 4000, 1, 8191, 300] * 6, 16, 9 * 4, 3 * 4, 64)]


@cuda
@pytest.mark.parametrize("kv_codec", CODECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", GPU_CASES, ids=["llama8b-4k", "ragged"])
def test_gpu_decode_attention_at_full_size(case, dtype, kv_codec):
    lens, block_size, heads, kv_heads, dim = case
    c = Case(lens, block_size, heads, kv_heads, dim, kv_codec, dtype=dtype, device="cuda")
    ref = paged_decode_attention_ref(*c.args())
    # K/V magnitudes reach ~1e3 here: errors scale with the output's largest value.
    size = max(1.0, ref.abs().max().item())
    tol = 1e-4 if dtype == torch.float32 else 2e-2  # exp2 is approximate on the GPU
    tol = dict(atol=tol * size, rtol=tol)
    for splits in (1, None):
        torch.testing.assert_close(paged_decode_attention_triton(*c.args(), splits), ref, **tol)


@cuda
@pytest.mark.parametrize("kv_codec", FLOAT_CODECS + CODECS[1:])
def test_gpu_kv_write_is_bitwise_the_reference(kv_codec):
    g = torch.Generator().manual_seed(4)
    tokens, kv_heads, dim, slots = 4096, 8, 128, 8192
    k, v = (special_kv(g, tokens, kv_heads, dim).cuda().bfloat16() for _ in range(2))
    slot_mapping = torch.randperm(slots, generator=g)[:tokens].cuda()
    outs = []
    for write in (kv_write_ref, kv_write_triton):
        store = storage_dtype(kv_codec, torch.bfloat16)
        got = [torch.zeros(slots, kv_heads, dim, dtype=store, device="cuda") for _ in range(2)]
        got += [torch.zeros(slots, kv_heads, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
        write(k, v, got[0], got[1], slot_mapping, got[2], got[3], kv_codec)
        outs.append(got)
    for a, b in zip(*outs):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
