"""Prefix sharing: hash and radix indexes, LRU eviction, salts, copy-on-write forks."""

from __future__ import annotations

import pytest
import torch
from conftest import small_engine
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab import texts
from kvlab.cache import HashPrefixIndex, KVPool, KVSpec, PagedCache, RadixPrefixIndex
from kvlab.config import SamplingParams
from kvlab.sequence import Sequence

INDEXES = {"hash": HashPrefixIndex, "radix": RadixPrefixIndex}


@pytest.fixture(scope="module")
def shared_prompts(model) -> list[list[int]]:
    """Token-id prompts: one shared 100-token preamble (not block-aligned), distinct tails."""
    preamble = model.tokenizer.encode(texts.preamble())[:100]
    return [preamble + model.tokenizer.encode(q) for q in texts.questions()[:5]]


@pytest.fixture(scope="module")
def unshared_outputs(model, shared_prompts):
    engine = small_engine(model, cache="paged", kv_budget_tokens=2048)
    return engine.generate(shared_prompts, SamplingParams(max_new_tokens=10), chat=False)


@pytest.mark.parametrize("kind", ["hash", "radix"])
def test_prefix_caching_keeps_greedy_outputs(model, shared_prompts, unshared_outputs, kind):
    engine = small_engine(
        model, cache="paged", prefix_caching=kind, kv_budget_tokens=2048, max_num_seqs=1
    )
    outputs = engine.generate(shared_prompts, SamplingParams(max_new_tokens=10), chat=False)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in unshared_outputs]
    hits = [o.metrics.prefix_hit_tokens for o in outputs]
    # hash shares only the 6 full 16-token blocks; radix matches token by token, so it
    # also reuses the preamble's last 4 tokens (and any tokens the questions share).
    if kind == "hash":
        assert hits == [0, 96, 96, 96, 96]
    else:
        assert hits[0] == 0 and min(hits[1:]) >= 100
    stats = engine.stats()
    assert stats["prefix_hit_tokens"].sum() == sum(hits)
    assert stats["prefix_query_tokens"].sum() == sum(len(p) for p in shared_prompts)
    engine.cache.check_integrity()
    assert engine.cache.allocator.num_used == 0


@pytest.mark.parametrize("kind", ["hash", "radix"])
@pytest.mark.parametrize("chunked", [False, True])
def test_requests_admitted_in_one_step_share_its_blocks(
    model, shared_prompts, unshared_outputs, kind, chunked
):
    # All five arrive together and are admitted in the first step: the first computes the
    # preamble's 6 full blocks, the other four share them in that very step (as vLLM V1).
    engine = small_engine(
        model,
        cache="paged",
        prefix_caching=kind,
        kv_budget_tokens=2048,
        chunked_prefill=chunked,
        poison_freed=True,
    )
    outputs = engine.generate(shared_prompts, SamplingParams(max_new_tokens=10), chat=False)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in unshared_outputs]
    assert [o.metrics.prefix_hit_tokens for o in outputs] == [0, 96, 96, 96, 96]
    assert engine.stats()["prefix_hit_tokens"].iloc[0] == 4 * 96  # all in step 1
    engine.cache.check_integrity()
    assert engine.cache.allocator.num_used == 0


def test_poisoned_eviction_keeps_outputs(model, shared_prompts, unshared_outputs):
    # 10 blocks: every request evicts cached blocks of earlier ones.
    engine = small_engine(
        model,
        cache="paged",
        prefix_caching="radix",
        kv_budget_tokens=160,
        poison_freed=True,
        max_num_seqs=1,
    )
    outputs = engine.generate(shared_prompts, SamplingParams(max_new_tokens=10), chat=False)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in unshared_outputs]
    assert engine.cache.allocator.evictions > 0
    engine.cache.check_integrity()


def test_salts_isolate_tenants_and_new_versions_miss(model, shared_prompts):
    engine = small_engine(model, cache="paged", prefix_caching="hash", max_num_seqs=1)
    params = SamplingParams(max_new_tokens=2)

    def hit(prompt, salt=None):
        request = engine.add_request(prompt, params, chat=False, salt=salt)
        while engine.has_unfinished():
            engine.step()
        return next(o for o in engine.finished if o.request_id == request).metrics

    prompt = shared_prompts[0]
    assert hit(prompt, "tenant-a").prefix_hit_tokens == 0
    assert hit(prompt, "tenant-b").prefix_hit_tokens == 0  # another tenant: no sharing
    assert hit(prompt, "tenant-a").prefix_hit_tokens == 16 * ((len(prompt) - 1) // 16)
    edited = list(prompt)
    edited[40] = edited[40] + 1  # a new prompt version: changed token in block 2
    assert hit(edited, "tenant-a").prefix_hit_tokens == 32
    engine.cache.check_integrity()


def test_n_samples_share_the_prompt_with_copy_on_write(model, shared_prompts):
    prompt = shared_prompts[1]  # not block-aligned: the last prompt block is shared, partial
    engine = small_engine(model, cache="paged", kv_budget_tokens=2048, record_block_map=True)
    greedy = engine.generate([prompt], SamplingParams(max_new_tokens=8), chat=False)[0]
    forked = engine.generate([prompt], SamplingParams(max_new_tokens=8, n=3), chat=False)[0]
    assert [s.token_ids for s in forked.samples] == [greedy.token_ids] * 3
    assert engine.cache.copied_blocks == 2  # two of three writers copy the shared block
    assert -2 in {o for bm in engine.telemetry.block_maps for o in bm}  # shared blocks seen
    engine.cache.check_integrity()
    assert engine.cache.allocator.num_used == 0

    sampled = engine.generate(
        [prompt], SamplingParams(max_new_tokens=12, n=4, temperature=1.0, seed=3), chat=False
    )[0]
    assert len({tuple(s.token_ids) for s in sampled.samples}) > 1


def test_n_above_one_needs_the_paged_cache(model):
    with pytest.raises(ValueError, match="needs EngineConfig"):
        small_engine(model).add_request("hi", SamplingParams(n=2))


def _poke(cache: PagedCache, seq: Sequence, salt_id: int, start: int, end: int) -> None:
    """Write a value encoding (salt, position, token) into each slot of [start, end)."""
    cache.ensure_capacity(seq, end)
    table, bs = cache.block_table(seq), cache.block_size
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(start, end)])
    values = torch.tensor(
        [salt_id * 100_000 + p * 100 + seq.token_ids[p] for p in range(start, end)],
        dtype=torch.float32,
    ).view(-1, 1, 1)
    cache.pool.write(0, slots, values, values)
    seq.num_computed = end


def _read(cache: PagedCache, seq: Sequence) -> list[float]:
    table, bs = cache.block_table(seq), cache.block_size
    slots = torch.tensor([[table[p // bs] * bs + p % bs for p in range(seq.num_computed)]])
    return cache.pool.gather(0, slots)[0].flatten().tolist()


@settings(max_examples=40, deadline=None)
@given(
    kind=st.sampled_from(["hash", "radix"]),
    block_size=st.sampled_from([2, 4, 8]),
    num_blocks=st.integers(12, 40),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["admit", "grow", "finish", "cancel"]),
            st.integers(0, 3),  # salt / prefix family
            st.integers(0, 10**6),
        ),
        min_size=1,
        max_size=120,
    ),
)
def test_random_sharing_keeps_invariants_and_contents(kind, block_size, num_blocks, ops):
    pool = KVPool(KVSpec(1, 1, 1), num_blocks * block_size, torch.float32, torch.device("cpu"))
    cache = PagedCache(pool, block_size, 64, prefix_index=INDEXES[kind](block_size))
    prefixes = [[(7 * f + i) % 50 for i in range(23)] for f in range(4)]
    running: list[tuple[Sequence, int]] = []
    for step, (op, family, r) in enumerate(ops):
        if op == "admit":
            prompt = prefixes[family][: 1 + r % 23] + [r % 50] * (r % 5)
            seq = Sequence(step, prompt, SamplingParams(max_new_tokens=1 + r % 6))
            seq.salt = f"s{family % 2}"
            salt_id = family % 2
            if cache.allocate_slots(seq) is not None:
                _poke(cache, seq, salt_id, seq.num_computed, len(prompt))
                cache.publish(seq)
                running.append((seq, salt_id))
        elif op == "grow" and running:
            seq, salt_id = running[r % len(running)]
            if len(seq.output_ids) < seq.params.max_new_tokens:
                seq.output_ids.append(r % 50)
                _poke(cache, seq, salt_id, seq.num_computed, seq.num_tokens)
        elif op in ("finish", "cancel") and running:
            cache.free(running.pop(r % len(running))[0])
        cache.check_integrity()
        for seq, salt_id in running:  # every readable slot holds this sequence's own state
            expected = [salt_id * 100_000 + p * 100 + t for p, t in enumerate(seq.token_ids)]
            assert _read(cache, seq) == expected[: seq.num_computed]
    for seq, _ in running:
        cache.free(seq)
    cache.check_integrity()
    assert cache.allocator.num_used == 0
    assert cache.allocator.num_free + cache.allocator.num_cached == num_blocks
    assert all(count == 0 for count in cache.allocator.ref_counts)
