"""Retention policies (kvlab.cache.retention): what they drop, that dropped blocks are never
read or shared, that positions stay the original ones, and that full retention changes
nothing. Engine tests use the tiny model; the HF reference runs the same tiny weights."""

from __future__ import annotations

import pytest
import torch

import kvlab
from kvlab.build import check_config
from kvlab.cache.pool import KVPool
from kvlab.cache.retention import DROPPED, RETENTION
from kvlab.cache.retention.h2o import HeavyHitterRetention
from kvlab.cache.retention.sinks import SinksRetention
from kvlab.cache.retention.window import WindowRetention
from kvlab.config import EngineConfig, SamplingParams
from kvlab.experiments import longctx
from kvlab.model.attention import pooled_attention
from kvlab.model.metadata import build_attention_metadata, build_retained_metadata
from kvlab.model.scored_attention import ScoredAttention

PROMPT = [5 + (7 * j) % 400 for j in range(120)]


def test_registry_names():
    assert set(RETENTION.names()) == {"full", "window", "sinks", "h2o"}


def test_window_and_sinks_drop_whole_blocks_outside_the_window():
    table = list(range(8))  # 30 tokens in blocks of 4: blocks 0-6 full, 7 the tail
    window = WindowRetention(block_size=4, num_blocks=8, window=10)
    assert window.drop(table, 30) == [0, 1, 2, 3, 4]  # positions 20..29 stay (blocks 5-7)
    sinks = SinksRetention(block_size=4, num_blocks=8, window=10, sinks=4)
    assert sinks.drop(table, 30) == [1, 2, 3, 4]
    table[1] = DROPPED
    assert sinks.drop(table, 30) == [2, 3, 4]  # a dropped block is not dropped twice
    assert window.drop(list(range(3)), 9) == []  # everything is in the window
    assert window.drop(list(range(4)), 12) == []  # positions 2-11: block 0 still in the window
    assert window.drop(list(range(4)), 14) == [0]


def test_h2o_keeps_the_most_attended_older_blocks():
    policy = HeavyHitterRetention(block_size=4, num_blocks=8, window=8, heavy=8)
    table = [7, 6, 5, 4, 3, 2, 1, 0]  # physical ids reversed: scores are per physical block
    policy.scores[:] = torch.tensor([0.0, 0, 0, 0, 5, 1, 9, 2], dtype=torch.float64)
    # 30 tokens: blocks 5-7 hold the window. Older blocks 0-4 sit in physical 7, 6, 5, 4,
    # 3 with scores 2, 9, 1, 5, 0: two blocks' worth (8 tokens) stay, logical 1 and 3.
    assert policy.drop(table, 30) == [0, 2, 4]
    policy.on_allocate(6)
    assert policy.scores[6] == 0


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(retention="lru"), "retention='lru' is unknown"),
        (dict(retention="window", retention_window=0), "retention_window=0"),
        (dict(retention="sinks", retention_sinks=-1), "retention_sinks=-1"),
        (dict(retention="window", cache="naive"), "needs cache='paged'"),  # at once
        (dict(retention="sinks", cache="paged", preemption="swap"), "needs preemption"),
        (dict(retention="h2o", cache="paged", attention="kernels"), "needs attention"),
    ],
)
def test_bad_retention_configs_raise(fields, message):
    with pytest.raises(ValueError, match=message):
        check_config(EngineConfig(**{"cache": "paged", **fields}))


def test_full_retention_is_token_identical(tiny_model):
    prompts = [PROMPT, PROMPT[:37], [900 + j for j in range(70)]]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    naive = kvlab.Engine(tiny_model, EngineConfig(max_model_len=256, kv_budget_tokens=768))
    paged = kvlab.Engine(
        tiny_model,
        EngineConfig(cache="paged", block_size=8, retention="full", chunked_prefill=True,
                     max_num_batched_tokens=16, max_model_len=256, kv_budget_tokens=768),
    )  # fmt: skip
    expected = [o.token_ids for o in naive.generate(prompts, params)]
    assert [o.token_ids for o in paged.generate(prompts, params)] == expected
    assert paged.cache.dropped_blocks == 0


def test_retained_metadata_without_drops_attends_like_the_plain_one(tiny_model):
    """The retained builder, on tables with nothing dropped, gives the same logits."""
    runner = kvlab.Engine(tiny_model, EngineConfig(cache="paged")).runner
    pool = KVPool(runner.kv_spec, 256, runner.dtype, runner.device)
    tables, starts, lens = [[0, 1, 2, 3], [4, 5, 6]], [0, 0], [50, 40]
    ids = torch.tensor(PROMPT[:50] + PROMPT[60:100])
    plain = build_attention_metadata(starts, lens, tables, 16, runner.device)
    runner.forward(ids, plain, pool)
    step = [torch.tensor([7, 8]), [50, 40], [1, 1]]
    expected = runner.forward(step[0], build_attention_metadata(step[1], step[2], tables, 16,
                              runner.device), pool)  # fmt: skip
    got = runner.forward(step[0], build_retained_metadata(step[1], step[2], tables, 16,
                         runner.device), pool)  # fmt: skip
    torch.testing.assert_close(got, expected)


def test_retained_metadata_keeps_original_positions():
    tables = [[DROPPED, 5, DROPPED, 7]]  # block size 4: positions 4-7 and 12-15 are kept
    meta = build_retained_metadata([15], [1], tables, 4, torch.device("cpu"))
    assert meta.positions.tolist() == [15]  # not 7, its rank among kept tokens
    assert meta.slot_mapping.tolist() == [7 * 4 + 3]
    assert meta.context_slots.tolist() == [[20, 21, 22, 23, 28, 29, 30, 31]]
    assert meta.context_lens.tolist() == [8]
    chunk = build_retained_metadata([13], [3], tables, 4, torch.device("cpu"))
    assert chunk.positions.tolist() == [13, 14, 15]
    mask = chunk.groups[0].mask[0, 0].int().tolist()  # rows: queries 13-15; cols: kept keys
    assert mask == [[1, 1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1, 0], [1] * 8]


@pytest.mark.parametrize("policy", ["window", "sinks"])
def test_matches_hf_with_the_kept_positions_masked(tiny_model, policy):
    """Teacher-forced through the paged cache with drops between chunks = one HF forward
    whose 4D mask shows each query what was kept when it ran, at original positions."""
    bs, window, chunk, sinks = 8, 40, 24, 8
    config = EngineConfig(
        cache="paged",
        block_size=bs,
        retention=policy,
        retention_window=window,
        retention_sinks=sinks,
        poison_freed=True,
    )
    runner = kvlab.Engine(tiny_model, EngineConfig(cache="paged")).runner
    ids = PROMPT[:100] + [900 + j for j in range(100)]
    scored = longctx.score(runner, ids, config, chunk=chunk, keep_logits=True)
    n = len(ids) - 1
    visible = torch.zeros(n, n, dtype=torch.bool)
    for start in range(0, n, chunk):
        recent = max(start - window, 0) // bs  # first block still in the window
        for p in range(start, min(start + chunk, n)):
            for j in range(p + 1):
                kept_sink = policy == "sinks" and j // bs < sinks // bs
                visible[p, j] = j >= start or j // bs >= recent or kept_sink
    assert not visible.tril().all()  # something was dropped
    hf = tiny_model.hf_model
    mask = torch.zeros(1, 1, n, n).masked_fill(~visible, torch.finfo(torch.float32).min)
    with torch.no_grad():
        expected = hf(torch.tensor([ids[:-1]]), attention_mask=mask).logits[0]
        causal = hf(torch.tensor([ids[:-1]])).logits[0]
    torch.testing.assert_close(scored.logits, expected, atol=1e-4, rtol=1e-4)
    assert (scored.logits - causal).abs().max() > 1e-2  # the drops did change something
    assert torch.isfinite(scored.nll).all()  # never read a poisoned (dropped) slot


@pytest.mark.parametrize("policy", ["window", "sinks", "h2o"])
def test_engine_memory_stays_flat(tiny_model, policy):
    base = EngineConfig(
        cache="paged",
        block_size=8,
        chunked_prefill=True,
        poison_freed=True,
        max_num_batched_tokens=16,
        max_model_len=512,
        kv_budget_tokens=1024,
    )
    config = longctx.budget_config(base, policy, 48)
    engine = kvlab.Engine(tiny_model, config)
    engine.add_request(PROMPT, SamplingParams(max_new_tokens=250, ignore_eos=True))
    bound = engine.cache.retention.kept_blocks() + 16 // 8  # kept + one chunk in flight
    while engine.has_unfinished():
        engine.step()
        engine.cache.check_integrity()
        assert engine.cache.allocator.num_used <= bound
    assert engine.cache.dropped_blocks > 30
    assert engine.cache.allocator.num_used == 0
    assert all(t > 0 for t in engine.finished[0].token_ids[:5])


@pytest.mark.parametrize("index", ["hash", "radix"])
@pytest.mark.parametrize("policy, hit_blocks", [("window", 0), ("sinks", 1)])
def test_prefix_index_never_hands_out_a_dropped_block(tiny_model, index, policy, hit_blocks):
    config = EngineConfig(
        cache="paged",
        block_size=8,
        prefix_caching=index,
        retention=policy,
        retention_window=32,
        retention_sinks=8,
        chunked_prefill=True,
        max_num_batched_tokens=16,
        max_model_len=256,
        kv_budget_tokens=512,
    )
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    engine = kvlab.Engine(tiny_model, config)
    engine.generate([PROMPT], params)
    cache = engine.cache
    cache.check_integrity()  # includes: no free block is in the prefix index
    match = cache.index.match(PROMPT, None)
    assert len(match.blocks) == hit_blocks
    assert all(b not in cache.allocator.free_blocks for b in match.blocks)
    [again] = engine.generate([PROMPT], params)
    assert again.metrics.prefix_hit_tokens == hit_blocks * 8
    fresh = kvlab.Engine(tiny_model, EngineConfig(**{**config.__dict__, "prefix_caching": None}))
    [solo] = fresh.generate([PROMPT], params)
    if hit_blocks == 0:
        assert again.token_ids == solo.token_ids  # nothing was shared: the very same run


def test_a_dropped_block_leaves_the_index_and_goes_back_to_the_free_list(tiny_model):
    config = EngineConfig(cache="paged", block_size=8, prefix_caching="hash", retention="window",
                          retention_window=16, max_model_len=256, kv_budget_tokens=512)  # fmt: skip
    engine = kvlab.Engine(tiny_model, config)
    cache = engine.cache
    seq = engine.make_sequence(PROMPT[:64], SamplingParams(max_new_tokens=4))
    cache.allocate_slots(seq, alone=True)
    cache.publish(seq, 64)
    first = list(cache.block_table(seq))
    assert all(b in cache.index for b in first)
    seq.num_computed = 64
    cache.retain(seq)
    table = cache.block_table(seq)
    assert table[:6] == [DROPPED] * 6 and table[6:] == first[6:]
    for block in first[:6]:
        assert block not in cache.index and block in cache.allocator.free_blocks
    cache.check_integrity()
    assert cache.index.match(PROMPT[:64], None).blocks == []
    cache.free(seq)
    cache.check_integrity()


def test_a_shared_block_survives_one_holders_drop(tiny_model):
    config = EngineConfig(cache="paged", block_size=8, prefix_caching="hash", retention="window",
                          retention_window=16, max_model_len=256, kv_budget_tokens=512)  # fmt: skip
    engine = kvlab.Engine(tiny_model, config)
    cache = engine.cache
    a = engine.make_sequence(PROMPT[:64], SamplingParams(max_new_tokens=4))
    cache.allocate_slots(a, alone=True)
    a.num_computed = 64
    cache.publish(a)
    b = engine.make_sequence(PROMPT[:64] + [3, 4], SamplingParams(max_new_tokens=4))
    cache.allocate_slots(b)
    shared = cache.block_table(b)[:8]
    assert shared == cache.block_table(a)[:8]
    cache.retain(a)
    assert all(cache.allocator.ref_counts[x] == 1 and x in cache.index for x in shared[:6])
    cache.check_integrity()
    cache.free(a)
    cache.free(b)
    cache.check_integrity()
    assert cache.allocator.num_used == 0


def test_forked_samples_keep_dropped_entries(tiny_model):
    config = EngineConfig(cache="paged", block_size=8, retention="sinks", retention_window=24,
                          retention_sinks=8, max_model_len=256, kv_budget_tokens=1024)  # fmt: skip
    engine = kvlab.Engine(tiny_model, config)
    engine.add_request(PROMPT, SamplingParams(max_new_tokens=60, n=3, temperature=0.8, seed=1))
    while engine.has_unfinished():
        engine.step()
        engine.cache.check_integrity()
    assert len(engine.finished[0].samples) == 3
    assert engine.cache.allocator.num_used == 0


def test_scored_attention_returns_the_same_output_and_counts_all_mass(tiny_model):
    engine = kvlab.Engine(tiny_model, EngineConfig(cache="paged"))
    runner = engine.runner
    pool = KVPool(runner.kv_spec, 128, runner.dtype, runner.device)
    scores = torch.zeros(8, dtype=torch.float64)
    meta = build_attention_metadata([0, 0], [40, 30], [[0, 1, 2], [4, 5]], 16, runner.device)
    ids = torch.tensor(PROMPT[:40] + PROMPT[50:80])
    expected = runner.forward(ids, meta, pool)
    runner.use_attention(ScoredAttention(pooled_attention, scores, 16, rows=4))
    got = runner.forward(ids, meta, pool)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    layers, heads = runner.kv_spec.num_layers, runner.num_heads
    assert float(scores.sum()) == pytest.approx(layers * heads * 4 * 2)  # 4 rows x 2 seqs
    assert scores[3] == 0 and scores[6] == 0  # never attended
    assert scores[0] > 0 and scores[4] > 0
