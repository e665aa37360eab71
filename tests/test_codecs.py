"""KV codecs: error bounds on random tensors, exact zeros, NaN/inf, poison, KIVI's window,
bytes per token, and the engine generating through every codec."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlab
from kvlab import texts
from kvlab.build import check_config
from kvlab.cache import make_cache
from kvlab.cache.codecs import CODECS, StoredKV
from kvlab.cache.codecs.kivi2 import Kivi2
from kvlab.cache.codecs.quant import group_size
from kvlab.cache.pool import KVPool
from kvlab.cache.spec import KVSpec
from kvlab.config import EngineConfig
from kvlab.units import round_up

CPU = torch.device("cpu")
NAMES = CODECS.names()  # every registered codec but the baseline (None)
ROUNDING = 1 + 2**-8  # a bf16 scale may be this much larger than the exact one


def roundtrip(name, k, v, chunks=(None,)):
    """Write (T, H, D) K/V into slots 0..T-1 of a 1-layer pool in the given chunks, read back."""
    t, h, d = k.shape
    pool = KVPool(KVSpec(1, h, d), round_up(t, 64), torch.float32, CPU, name)
    start = 0
    for size in (*chunks[:-1], t):
        end = min(t, start + size) if size else t
        if end > start:
            slots = torch.arange(start, end)
            pool.write(0, slots, k[start:end], v[start:end])
        start = end
    k_hat, v_hat = pool.gather(0, torch.arange(t)[None])
    return pool, k_hat[0], v_hat[0]


def symmetric_bound(x, qmax, group):
    """s / 2 with s the largest bf16 scale amax / qmax can round to, per element."""
    g = x.double().unflatten(-1, (-1, group))
    s = g.abs().amax(-1, keepdim=True) / qmax * ROUNDING
    return (s / 2).expand_as(g).flatten(-2)


def asymmetric_bound(x, dim):
    """s / 2 for 4 levels over min..max along dim (zero rounded down to bf16 first: by up
    to one bf16 step, 2^-7 of |min|)."""
    x = x.double()
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    s = (hi - lo + lo.abs() * 2**-7) / 3 * ROUNDING
    return (s / 2 + 1e-6 * torch.maximum(lo.abs(), hi.abs())).expand_as(x)


def bound(name, x):
    """Each codec's documented per-element error bound for one (T, H, D) tensor."""
    ax = x.double().abs()
    if name is None:
        return torch.zeros_like(ax)
    if name == "fp16":
        return torch.clamp(ax * 2**-11, min=2**-25)
    if name == "bf16":
        return ax * 2**-8
    if name == "int8":
        return symmetric_bound(x, 127, x.shape[-1])
    if name == "int4":
        return symmetric_bound(x, 7, group_size(x.shape[-1]))
    fp8_max, rel, sub = {"fp8_e4m3": (448, 2**-4, 2**-10), "fp8_e5m2": (57344, 2**-3, 2**-17)}[name]
    s = ax.amax(-1, keepdim=True) / fp8_max * ROUNDING
    return ax * rel + sub * s


@st.composite
def kv_pair(draw):
    t = draw(st.integers(1, 40))
    h = draw(st.integers(1, 3))
    d = draw(st.sampled_from([4, 8, 32, 64, 96]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    scale = 10.0 ** draw(st.integers(-20, 30))
    outlier = draw(st.sampled_from([1.0, 100.0]))
    zeros = draw(st.sampled_from([0.0, 0.3, 1.0]))

    def one():
        x = torch.randn(t, h, d, generator=gen) * scale
        x[..., 0] *= outlier  # an outlier channel
        return torch.where(torch.rand(t, h, d, generator=gen) < zeros, 0.0, x)

    chunks = tuple(draw(st.lists(st.integers(1, 20), max_size=4))) + (None,)
    return one(), one(), chunks


@pytest.mark.parametrize("name", [None, "fp16", "bf16", "int8", "fp8_e4m3", "fp8_e5m2", "int4"])
@settings(max_examples=40, deadline=None)
@given(data=kv_pair())
def test_per_token_codecs_stay_within_their_bound(name, data):
    k, v, chunks = data
    if name == "fp16" and max(k.abs().max(), v.abs().max()) > 65504:
        with pytest.raises(ValueError, match="fp16"):
            roundtrip(name, k, v, chunks)
        return
    _, k_hat, v_hat = roundtrip(name, k, v, chunks)
    for x, x_hat in ((k, k_hat), (v, v_hat)):
        err = (x_hat.double() - x.double()).abs()
        assert bool((err <= bound(name, x)).all()), float((err - bound(name, x)).max())
        if name not in (None, "fp16", "bf16"):
            assert bool((x_hat[x == 0] == 0).all())  # symmetric codes keep zeros exact


@settings(max_examples=40, deadline=None)
@given(data=kv_pair())
def test_kivi2_stays_within_its_bound_and_keeps_the_window_exact(data):
    k, v, chunks = data
    _, k_hat, v_hat = roundtrip("kivi2", k, v, chunks)
    t, _, d = k.shape
    done = t // 16 * 16  # tokens in complete 16-token groups; the rest is the window
    if done:
        keys = k[:done].unflatten(0, (-1, 16))  # (groups, 16, H, D): per channel over tokens
        err = (k_hat[:done].double() - k[:done].double()).abs()
        assert bool((err <= asymmetric_bound(keys, dim=1).flatten(0, 1)).all())
        vals = v[:done].unflatten(-1, (-1, group_size(d)))  # per token per 32 channels
        err = (v_hat[:done].double() - v[:done].double()).abs()
        assert bool((err <= asymmetric_bound(vals, dim=-1).flatten(-2)).all())
    assert torch.equal(k_hat[done:], k[done:]) and torch.equal(v_hat[done:], v[done:])


@pytest.mark.parametrize("name", [None, *NAMES])
def test_zeros_round_trip_exactly(name):
    zeros = torch.zeros(37, 3, 64)
    _, k_hat, v_hat = roundtrip(name, zeros, zeros, chunks=(5, 1, 1, None))
    assert torch.equal(k_hat, zeros) and torch.equal(v_hat, zeros)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_input_is_rejected(name, bad):
    k, v = torch.randn(20, 3, 64), torch.randn(20, 3, 64)
    v[7, 1, 3] = bad
    with pytest.raises(ValueError, match=f"kv_codec='{name}'.*NaN or inf"):
        roundtrip(name, k, v)


def test_the_baseline_stores_non_finite_values_as_they_are():
    k = torch.randn(4, 1, 8)
    k[1, 0, 2] = math.nan
    _, k_hat, _ = roundtrip(None, k, k)
    torch.testing.assert_close(k_hat, k, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("name", [None, *NAMES])
def test_layer_by_layer_moves_equal_whole_moves_bit_for_bit(name):
    """KV connectors load and save one layer at a time (read_layer / restore_layer)."""
    pool = KVPool(KVSpec(3, 2, 32), 96, torch.float32, torch.device("cpu"), name)
    if not pool.layerwise:
        with pytest.raises(NotImplementedError, match="every layer at once"):
            pool.read_layer(0, torch.arange(16))
        return
    for layer in range(3):
        pool.write(layer, torch.arange(40), torch.randn(40, 2, 32), torch.randn(40, 2, 32))
    source, target = torch.arange(8, 24), torch.arange(64, 80)
    whole = pool.read(source)
    parts = StoredKV.cat([pool.read_layer(layer, source) for layer in range(3)])
    for layer in (2, 0, 1):  # any order
        pool.restore_layer(layer, target, whole)
    moved = pool.read(target)
    for key, tensor in whole.tensors.items():
        bits = tensor.view(torch.uint8)
        assert torch.equal(parts.tensors[key].view(torch.uint8), bits), key
        assert torch.equal(moved.tensors[key].view(torch.uint8), bits), key


@pytest.mark.parametrize("name", [None, *NAMES])
def test_poison_makes_reads_nan(name):
    pool, _, _ = roundtrip(
        name, torch.randn(40, 2, 32), torch.randn(40, 2, 32), chunks=(33, 1, None)
    )
    pool.poison(torch.arange(32, 48))  # one complete group and the window group (kivi2)
    k, v = pool.gather(0, torch.arange(40)[None])
    assert k[0, 32:].isnan().all() and v[0, 32:].isnan().all()
    assert k[0, :32].isfinite().all() and v[0, :32].isfinite().all()


# --- KIVI's window and slot bookkeeping ------------------------------------------------------
def test_kivi2_token_by_token_equals_one_shot_for_interleaved_sequences():
    k, v = torch.randn(64, 3, 64), torch.randn(64, 3, 64)
    _, k_one, v_one = roundtrip("kivi2", k, v)
    pool = KVPool(KVSpec(1, 3, 64), 64, torch.float32, CPU, "kivi2")
    order = [i for pair in zip(range(0, 30), range(32, 62)) for i in pair]  # two sequences
    for slot in order:
        pool.write(0, torch.tensor([slot]), k[slot : slot + 1], v[slot : slot + 1])
    k_hat, v_hat = (x[0] for x in pool.gather(0, torch.arange(64)[None]))
    for done in (range(0, 16), range(32, 48)):  # complete groups: same codes as one shot
        assert torch.equal(k_hat[done], k_one[done]) and torch.equal(v_hat[done], v_one[done])
    for window in (range(16, 30), range(48, 62)):  # incomplete groups: exact
        assert torch.equal(k_hat[window], k[window]) and torch.equal(v_hat[window], v[window])
    assert len(pool.codec.buffer_of) == 2  # one window buffer per sequence's tail


def test_kivi2_reclaims_a_stale_window_when_its_group_is_reused():
    pool = KVPool(KVSpec(2, 1, 8), 32, torch.float32, CPU, "kivi2")
    old = torch.randn(5, 1, 8) * 100
    for layer in range(2):
        pool.write(layer, torch.arange(5), old, old)  # a sequence ends mid-group
    new = torch.randn(16, 1, 8)
    for start, end in ((0, 3), (3, 16)):  # the group's next owner writes it from its first slot
        for layer in range(2):
            pool.write(layer, torch.arange(start, end), new[start:end], new[start:end])
    _, k_ref, _ = roundtrip("kivi2", new, new)
    k_hat, _ = pool.gather(1, torch.arange(16)[None])
    assert torch.equal(k_hat[0], k_ref)
    assert pool.codec.buffer_of == {}  # released once the last layer completed the group


def test_kivi2_rewriting_a_token_of_a_quantized_group_keeps_the_others():
    k = torch.randn(16, 1, 8)
    pool, k_before, _ = roundtrip("kivi2", k, k)
    fresh = torch.randn(1, 1, 8)
    pool.write(0, torch.tensor([15]), fresh, fresh)
    k_after, v_after = (x[0] for x in pool.gather(0, torch.arange(16)[None]))
    assert torch.equal(k_after[:15], k_before[:15]) and torch.equal(k_after[15], fresh[0])


# --- bytes and budgets ------------------------------------------------------------------------
SMOLLM2 = KVSpec(num_layers=30, num_kv_heads=3, head_dim=64)
EXPECTED_BYTES = {
    None: 2 * 30 * 3 * 64 * 4,  # fp32: 46080
    "fp16": 2 * 30 * 3 * 64 * 2,  # 23040
    "bf16": 2 * 30 * 3 * 64 * 2,
    "int8": 2 * 30 * 3 * (64 + 2),  # codes + one bf16 scale per head: 11880
    "fp8_e4m3": 2 * 30 * 3 * (64 + 2),
    "fp8_e5m2": 2 * 30 * 3 * (64 + 2),
    "int4": 2 * 30 * 3 * (32 + 2 * 2),  # 64 nibbles + two bf16 group scales: 6480
    # K: 16 B codes + 64 channels x (scale, zero) x 2 B / 16 tokens; V: 16 B + 2 x 4 B
    "kivi2": 30 * 3 * ((16 + 64 * 4 // 16) + (16 + 2 * 4)),  # 5040
}


@pytest.mark.parametrize("name", [None, *NAMES])
def test_bytes_per_token_count_codes_and_scales(name):
    pool = KVPool(SMOLLM2, 64, torch.float32, CPU, name)
    assert pool.bytes_per_token == EXPECTED_BYTES[name]


@pytest.mark.parametrize("name", [None, *NAMES])
def test_a_byte_budget_buys_budget_over_bytes_per_token_slots(name):
    budget = 64 * 2**20
    config = EngineConfig(cache="paged", kv_budget_bytes=budget, kv_codec=name)
    cache = make_cache(config, SMOLLM2, torch.float32, CPU, max_model_len=1024)
    assert cache.pool.num_slots == budget // EXPECTED_BYTES[name] // 16 * 16
    assert cache.memory().budget_bytes == cache.pool.num_slots * EXPECTED_BYTES[name]


def test_bad_codec_names_are_rejected():
    """Named when an engine is built (kvlab.build.check_config; config.py is a leaf)."""
    with pytest.raises(ValueError, match="EngineConfig.kv_codec='int3' is unknown"):
        check_config(EngineConfig(kv_codec="int3"))


def test_kivi2_needs_blocks_of_whole_key_groups():
    config = EngineConfig(cache="paged", block_size=8, kv_codec="kivi2")
    with pytest.raises(ValueError, match="EngineConfig.block_size=8 must be a multiple of 16"):
        make_cache(config, SMOLLM2, torch.float32, CPU, max_model_len=1024)


# --- through the engine ------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_the_engine_generates_through_every_codec(model, chat_prompts, name):
    config = EngineConfig(cache="paged", kv_codec=name, max_model_len=256, kv_budget_tokens=512)
    engine = kvlab.Engine(model, config)
    params = kvlab.SamplingParams(max_new_tokens=6, ignore_eos=True)
    outputs = engine.generate(chat_prompts[:2], params)
    assert [len(o.token_ids) for o in outputs] == [6, 6]
    engine.cache.check_integrity()
    assert engine.cache.memory().budget_bytes == 512 * EXPECTED_BYTES[name]


@pytest.mark.slow
def test_kivi2_runs_in_the_naive_cache_too(model):
    """The naive cache gives kivi2 the groups the paged one does (16 consecutive positions
    of one sequence, from a 16-aligned offset), so the greedy tokens equal the paged kivi2
    run's; and until a sequence fills its first group, every read comes from the exact
    window, so its tokens equal the full-precision cache's."""
    params = kvlab.SamplingParams(max_new_tokens=8, ignore_eos=True)

    def greedy(cache: str, kv_codec: str | None, prompts) -> list[list[int]]:
        config = EngineConfig(
            cache=cache, kv_codec=kv_codec, max_model_len=128, kv_budget_tokens=256
        )
        return [out.token_ids for out in kvlab.Engine(model, config).generate(prompts, params)]

    ids = model.tokenizer.encode(texts.heldout())
    # 44 and 37 tokens: two whole groups quantized at prefill, the rest in the window; the
    # first completes its third group while decoding (position 47)
    long = [ids[:44], ids[100:137]]
    naive = greedy("naive", "kivi2", long)
    assert naive == greedy("paged", "kivi2", long)
    assert all(len(tokens) == 8 for tokens in naive)
    short = [model.tokenizer.encode("The capital of France is")]
    assert len(short[0]) + 8 - 1 < Kivi2.group  # the last token written stays in the window
    assert greedy("naive", "kivi2", short) == greedy("naive", None, short)


@pytest.mark.slow
def test_a_shared_prefix_block_is_quantized_once(model, chat_prompts):
    config = EngineConfig(
        cache="paged", prefix_caching="hash", kv_codec="int8", max_model_len=256,
        kv_budget_tokens=1024,
    )  # fmt: skip
    engine = kvlab.Engine(model, config)
    codec, written = engine.cache.pool.codec, []
    write = codec.write

    def counting_write(layer, slots, k, v):
        written.extend(slots.tolist() if layer == 0 else [])
        write(layer, slots, k, v)

    codec.write = counting_write
    params = kvlab.SamplingParams(max_new_tokens=4, ignore_eos=True)
    [first] = engine.generate(chat_prompts[:1], params)
    first_writes, written[:] = len(written), []
    [second] = engine.generate(chat_prompts[:1], params)  # its full prompt blocks are cached
    assert second.token_ids == first.token_ids
    shared = len(first.prompt_token_ids) // 16 * 16
    assert shared >= 16 and len(written) == first_writes - shared
