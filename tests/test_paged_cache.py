"""The paged cache: allocator invariants under random operations, and engine equivalence."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy, small_engine
from hypothesis import example, given, settings
from hypothesis import strategies as st

import kvlab
from kvlab.cache import BlockAllocator, KVPool, KVSpec, OutOfBlocks, PagedCache
from kvlab.config import SamplingParams
from kvlab.sequence import Sequence


def _cache(num_blocks: int, block_size: int, max_model_len: int = 256) -> PagedCache:
    pool = KVPool(KVSpec(1, 1, 2), num_blocks * block_size, torch.float32, torch.device("cpu"))
    return PagedCache(pool, block_size, max_model_len)


def test_allocator_refcounts_and_errors():
    alloc = BlockAllocator(3)
    a, b = alloc.allocate(), alloc.allocate()
    alloc.incref(a)
    assert not alloc.decref(a) and alloc.decref(a) and alloc.decref(b)
    alloc.check_integrity()
    with pytest.raises(ValueError, match="double free"):
        alloc.decref(a)
    with pytest.raises(ValueError, match="is free"):
        alloc.incref(a)
    for _ in range(3):
        alloc.allocate()
    with pytest.raises(OutOfBlocks):
        alloc.allocate()


def test_a_new_block_only_when_the_last_is_full():
    cache = _cache(num_blocks=8, block_size=4)
    seq = Sequence(0, [1] * 5, SamplingParams(max_new_tokens=10))
    assert cache.allocate_slots(seq, 0) == []  # admitted, no token's block taken yet
    for tokens, blocks in [(1, 1), (4, 1), (5, 2), (8, 2), (9, 3)]:
        cache.ensure_capacity(seq, tokens)
        assert len(cache.block_table(seq)) == blocks
    seq.num_computed = 9
    assert cache.memory().waste_bytes == 3 * cache.pool.bytes_per_token  # tail of block 3
    cache.check_integrity()


def test_a_running_sequence_grows_through_allocate_slots_or_nothing_changes():
    cache = PagedCache(_cache(4, 4).pool, 4, 256, watermark=0.0)  # admits as vLLM V1
    a = Sequence(0, [1] * 8, SamplingParams(max_new_tokens=8))
    b = Sequence(1, [2] * 8, SamplingParams(max_new_tokens=8))
    assert len(cache.allocate_slots(a)) == len(cache.allocate_slots(b)) == 2  # pool full
    a.num_computed = b.num_computed = 8
    a.output_ids.append(3)  # one token pending: its block is the pool's fifth
    assert cache.allocate_slots(a, 1) is None  # no block free
    assert len(cache.block_table(a)) == 2
    assert cache.allocator.num_used == 4
    cache.free(b)
    assert len(cache.allocate_slots(a, 1)) == 3
    cache.check_integrity()


def test_admission_counts_the_worst_case():
    cache = _cache(num_blocks=4, block_size=4)  # 16 slots
    a = Sequence(0, [1] * 6, SamplingParams(max_new_tokens=2))  # 8 tokens: 2 blocks
    b = Sequence(1, [1] * 6, SamplingParams(max_new_tokens=6))  # 12 tokens: 3 blocks
    cache.allocate_slots(a, 0)
    assert cache.allocate_slots(b) is None  # 2 + 3 > 4, though no block is held yet
    assert b.request_id not in cache.sequences and cache.allocator.num_used == 0  # untouched
    cache.free(a)
    assert len(cache.allocate_slots(b)) == 2  # the prompt's 6 tokens, in 2 blocks
    huge = Sequence(2, [1] * 10, SamplingParams(max_new_tokens=10))
    with pytest.raises(ValueError, match="needs 5 blocks .* only 4 blocks"):
        cache.check_fits(huge)


def test_a_swapped_out_sequence_returns_only_with_its_worst_case_under_reserve():
    """Reserve admission promises every running sequence its worst case, so a sequence
    swapped back in (or a KV arrival) must find its own worst case, not only the blocks
    it holds now (the engine fuzz found it: a hand preemption under reserve, then a
    swap-in that left the promises larger than the blocks available)."""
    cache = _cache(num_blocks=8, block_size=16)
    a, b = (Sequence(i, [i + 1] * 16, SamplingParams(max_new_tokens=48)) for i in (0, 1))
    c = Sequence(2, [3] * 16, SamplingParams(max_new_tokens=16))  # 2 blocks at worst
    for seq in (a, b):  # 4 blocks each at worst, 1 held
        assert cache.allocate_slots(seq) is not None
        seq.num_computed = 16
    saved = cache.swap_out(b)
    assert cache.allocate_slots(c) is not None
    # a and c hold a block each and are promised 3 + 1 more: 6 available, room for 2
    assert cache.allocate_computed(b) is None  # b with its next token fits 2, not its worst 4
    assert b.request_id not in cache.sequences and cache.allocator.num_used == 2
    cache.check_integrity()
    cache.free(c)
    assert len(cache.allocate_computed(b)) == 1  # its 16 tokens; the 17th grows later
    cache.swap_in(b, saved)
    cache.check_integrity()


@settings(max_examples=60, deadline=None)
@example(block_size=1, num_blocks=4, ops=[("admit", 3)] + [("grow", 0)] * 3)  # to max_model_len
@given(
    block_size=st.sampled_from([1, 2, 4, 16]),
    num_blocks=st.integers(4, 40),
    ops=st.lists(
        st.tuples(st.sampled_from(["admit", "grow", "finish"]), st.integers(0, 10**6)),
        min_size=1,
        max_size=300,
    ),
)
def test_random_admit_grow_finish_keeps_every_invariant(block_size, num_blocks, ops):
    cache = _cache(num_blocks, block_size, max_model_len=num_blocks * block_size)
    running: list[Sequence] = []
    next_id = 0
    for op, r in ops:
        if op == "admit":
            prompt = 1 + r % (num_blocks * block_size // 2)
            seq = Sequence(next_id, [1] * prompt, SamplingParams(max_new_tokens=1 + r % 7))
            next_id += 1
            if cache.allocate_slots(seq) is not None:
                seq.num_computed = prompt
                running.append(seq)
        elif op == "grow" and running:
            seq = running[r % len(running)]
            # the engine stops a sequence at max_new_tokens or max_model_len, whichever first
            room = seq.num_tokens < cache.max_model_len
            if len(seq.output_ids) < seq.params.max_new_tokens and room:
                seq.output_ids.append(1)
                cache.ensure_capacity(seq, seq.num_tokens)  # never runs out: admission promised
                seq.num_computed = seq.num_tokens
        elif op == "finish" and running:
            cache.free(running.pop(r % len(running)))
        cache.check_integrity()
        for seq in running:  # nobody's table shares a block with anyone else's
            others = {b for s in running if s is not seq for b in cache.block_table(s)}
            assert not others & set(cache.block_table(seq))
    for seq in running:
        cache.free(seq)
    cache.check_integrity()
    assert cache.allocator.num_free == num_blocks
    assert cache.memory().reserved_bytes == 0


@pytest.fixture(scope="module")
def reference_outputs(model, chat_prompts):
    engine = small_engine(model)
    return engine.generate(chat_prompts[:6], SamplingParams(max_new_tokens=24))


@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_paged_greedy_equals_naive_and_hf(model, chat_prompts, reference_outputs, block_size):
    engine = small_engine(model, cache="paged", block_size=block_size, kv_budget_tokens=1024)
    outputs = engine.generate(chat_prompts[:6], SamplingParams(max_new_tokens=24))
    assert [o.token_ids for o in outputs] == [o.token_ids for o in reference_outputs]
    first = outputs[0]
    assert first.token_ids == hf_greedy(model, first.prompt_token_ids, 24)[: len(first.token_ids)]
    engine.cache.check_integrity()
    assert engine.cache.num_available == engine.cache.num_blocks


def test_poisoned_paged_blocks_never_leak(model, chat_prompts, reference_outputs):
    # A budget of 160 slots forces requests to reuse each other's freed blocks.
    engine = small_engine(
        model, cache="paged", block_size=4, kv_budget_tokens=160, poison_freed=True
    )
    outputs = engine.generate(chat_prompts[:6], SamplingParams(max_new_tokens=24))
    assert [o.token_ids for o in outputs] == [o.token_ids for o in reference_outputs]
    assert torch.isnan(engine.cache.pool.k).any()
    assert engine.stats()["waiting"].max() > 0


def test_a_request_that_can_never_fit_is_rejected(model, chat_prompts):
    engine = small_engine(model, cache="paged", block_size=16, kv_budget_tokens=64)
    engine.add_request(chat_prompts[0], SamplingParams(max_new_tokens=8))
    with pytest.raises(ValueError, match="only 4 blocks"):
        engine.add_request(chat_prompts[1], SamplingParams(max_new_tokens=200))
    outputs = {}
    while engine.has_unfinished():
        outputs.update({o.request_id: o for o in engine.step()})
    assert list(outputs) == [0]
    assert engine.cache.num_available == 4


def test_paged_holds_more_sequences_than_naive(model, chat_prompts):
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    peaks = {}
    for cache in ("naive", "paged"):
        engine = small_engine(model, cache=cache, kv_budget_tokens=1024)
        engine.generate(chat_prompts[:12], params)
        peaks[cache] = int(engine.stats()["running"].max())
    assert peaks["naive"] == 2 and peaks["paged"] >= 3 * peaks["naive"]


def test_block_map_and_request_stats(model, chat_prompts):
    engine = small_engine(model, cache="paged", kv_budget_tokens=512, record_block_map=True)
    engine.generate(chat_prompts[:3], kvlab.SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert len(engine.telemetry.block_maps) == len(engine.stats())
    owners = {o for bm in engine.telemetry.block_maps for o in bm}
    assert owners == {-1, 0, 1, 2}
    requests = engine.request_stats()
    assert list(requests["output_tokens"]) == [4, 4, 4]
    assert (requests["first_token_s"] >= requests["arrival_s"]).all()
