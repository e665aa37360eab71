"""The naive cache: reservation at admission, waiting when full, accounting, isolation."""

from __future__ import annotations

import torch
from conftest import small_engine

import kvlab
from kvlab.cache import KVPool, KVSpec, NaiveCache
from kvlab.config import SamplingParams
from kvlab.sequence import Sequence


def _seq(i: int, n: int = 10) -> Sequence:
    return Sequence(i, list(range(1, n + 1)), SamplingParams())


def test_regions_are_reserved_whole_and_returned():
    pool = KVPool(KVSpec(2, 1, 4), 3 * 16, torch.float32, torch.device("cpu"))
    cache = NaiveCache(pool, max_model_len=16)
    seqs = [_seq(i) for i in range(4)]
    for seq in seqs[:3]:
        assert cache.allocate_slots(seq) is not None
        cache.check_integrity()
    assert cache.allocate_slots(seqs[3]) is None and seqs[3].request_id not in cache.sequences
    assert [cache.block_table(s) for s in seqs[:3]] == [[0], [1], [2]]
    seqs[0].num_computed = 10
    memory = cache.memory()
    per_token = 2 * 2 * 1 * 4 * 4
    assert memory.reserved_bytes == 3 * 16 * per_token
    assert memory.live_bytes == 10 * per_token
    assert memory.waste_bytes == (48 - 10) * per_token
    cache.free(seqs[1])
    cache.check_integrity()
    assert cache.allocate_slots(seqs[3]) == [1]
    for seq in (seqs[0], seqs[2], seqs[3]):
        cache.free(seq)
    cache.check_integrity()
    assert cache.memory().reserved_bytes == 0


def test_requests_wait_until_a_region_frees(model, chat_prompts):
    engine = small_engine(model, kv_budget_tokens=2 * 512)
    outputs = engine.generate(chat_prompts[:5], SamplingParams(max_new_tokens=6))
    assert len(outputs) == 5
    stats = engine.stats()
    assert stats["running"].max() == 2
    assert stats["waiting"].max() >= 1
    assert (stats["reserved_bytes"] <= stats["budget_bytes"]).all()
    assert (stats["live_bytes"] <= stats["reserved_bytes"]).all()
    assert stats["reserved_bytes"].iloc[-1] == 0


def test_static_batching_waits_for_the_whole_batch(model, chat_prompts):
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (2, 12, 2, 2)]
    engine = small_engine(model, kv_budget_tokens=2 * 512, batching="static")
    engine.generate(chat_prompts[:4], params)
    stats = engine.stats()
    # The second batch is admitted only after the 12-token request of the first is done.
    prefills = stats.index[stats["phase"] == "prefill"].tolist()
    assert len(prefills) == 2
    between = stats.loc[prefills[0] + 1 : prefills[1] - 1]
    assert (between["phase"] == "decode").all() and len(between) == 11


def test_poisoned_freed_slots_never_leak_into_outputs(model, chat_prompts):
    """NaN-fill every freed region: later tenants of a region must not read the old state."""
    params = SamplingParams(max_new_tokens=12)
    clean = small_engine(model, kv_budget_tokens=2 * 512).generate(chat_prompts[:6], params)
    engine = small_engine(model, kv_budget_tokens=2 * 512, poison_freed=True)
    poisoned = engine.generate(chat_prompts[:6], params)
    assert [o.token_ids for o in poisoned] == [o.token_ids for o in clean]
    assert torch.isnan(engine.cache.pool.k).any()  # the poison really was written


def test_engine_config_default_budget(model):
    engine = kvlab.Engine(model)
    assert engine.max_model_len == 8192
    assert engine.cache.pool.num_slots == 32768
