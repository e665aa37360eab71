"""KV cache groups (kvlab.cache.groups) and the hybrid cache (kvlab.cache.hybrid): layers of
one kind share a block table per sequence over one pool; a sliding group frees what left
its window; a prefix hit is what every group serves. Greedy tokens equal transformers
running the same masks, with every layer full equal the paged cache's, and the cache is
whole after every step."""

from __future__ import annotations

import pytest
from conftest import WINDOW, gemma3_reference, hf_greedy
from test_attention_pattern import PROMPTS

import kvlab
from kvlab.cache.events import EventLog
from kvlab.cache.groups import KVCacheGroup, cross_group_hit, kv_cache_groups
from kvlab.cache.retention import DROPPED


def hybrid(**fields) -> kvlab.EngineConfig:
    return kvlab.EngineConfig(cache="hybrid", block_size=4, **fields)


def checked(engine: kvlab.Engine) -> kvlab.Engine:
    """`engine`, its cache checked whole after every step."""
    engine.observers.subscribe("after_step", lambda finished: engine.cache.check_integrity())
    return engine


# --- groups and the hit rule -----------------------------------------------------------
def test_layers_form_groups_of_the_fewest_layers_a_kind_has():
    gemma3 = (64,) * 5 + (None,)
    groups = kv_cache_groups(gemma3 * 5)
    assert [g.window for g in groups] == [None] + [64] * 5
    assert groups[0].layers == (5, 11, 17, 23, 29)
    assert groups[1].layers == (0, 1, 2, 3, 4) and groups[5].layers == (24, 25, 26, 27, 28)
    assert kv_cache_groups((None,) * 4) == [KVCacheGroup(None, (0, 1, 2, 3))]
    uneven = kv_cache_groups((8, 8, 8, None, None))  # 3 sliding, 2 full: groups of 2
    assert [g.layers for g in uneven] == [(3, 4), (0, 1), (2,)]


def test_a_sliding_group_needs_only_the_blocks_its_window_reaches():
    assert KVCacheGroup(32, (0,)).blocks_needed(16) == 2  # a query at p sees p - 31 on
    assert KVCacheGroup(17, (0,)).blocks_needed(16) == 1
    assert KVCacheGroup(None, (0,)).blocks_needed(16) is None


@pytest.mark.parametrize(
    "held, hit",
    [
        # per group, the prompt blocks it holds (0 full, 1 sliding needing 2): the hit
        (({0, 1, 2, 3, 4, 5}, {4, 5}), 6),  # the window's two last blocks: all 6
        (({0, 1, 2, 3}, {4, 5}), 0),  # full serves 4; sliding holds neither 2 nor 3
        (({0, 1, 2, 3, 4, 5}, {1, 2, 4}), 3),  # sliding: 5 missing -> 4 is alone -> 1, 2
        (({0, 1, 2, 3, 4, 5}, set()), 0),
        (({0, 1, 2, 3, 4, 5}, {0}), 1),  # a hit of 1 block needs only block 0
        ((set(), {0, 1, 2, 3, 4, 5}), 0),  # full attention holds nothing: no hit
    ],
)
def test_the_hit_is_the_longest_every_group_serves(held, hit):
    groups = [KVCacheGroup(None, (1,)), KVCacheGroup(32, (0,))]
    assert cross_group_hit(groups, lambda g, i: i in held[g], 6, 16) == hit


def test_two_windows_move_the_hit_until_both_serve_it():
    groups = [KVCacheGroup(32, (0,)), KVCacheGroup(48, (1,))]  # need 2 and 3 blocks
    held = ({0, 1, 2, 3, 5, 6}, {1, 2, 3, 4, 5, 6})  # 32: 7 or 4; 48: 7 or 4 -> 4 fails 48?
    # 48 at 7 needs 4, 5, 6: ok; 32 at 7 needs 5, 6: ok -> 7
    assert cross_group_hit(groups, lambda g, i: i in held[g], 7, 16) == 7
    held = ({0, 1, 2, 3, 6}, {1, 2, 3, 4, 5, 6})  # 32 at 7 misses 5 -> 4 (2, 3); 48 at 4: 1-3
    assert cross_group_hit(groups, lambda g, i: i in held[g], 7, 16) == 4
    held = ({0, 1, 2, 3, 6}, {2, 3, 4, 5, 6})  # 48 at 4 misses 1 -> 0
    assert cross_group_hit(groups, lambda g, i: i in held[g], 7, 16) == 0


# --- the engine ------------------------------------------------------------------------
@pytest.mark.parametrize("attention", ["torch", "kernels"])
@pytest.mark.parametrize("how", ["one-by-one", "batched chunks with prefix hits"])
def test_a_sliding_window_model_decodes_what_transformers_does(tiny_qwen, attention, how):
    config = hybrid(attention=attention)
    if how != "one-by-one":
        config = hybrid(attention=attention, prefix_caching="hash", chunked_prefill=True,
                        max_num_batched_tokens=12)  # fmt: skip
    engine = checked(kvlab.Engine(tiny_qwen, config))
    assert [g.window for g in engine.cache.groups] == [None, WINDOW]
    params = kvlab.SamplingParams(max_new_tokens=20, ignore_eos=True)
    if how == "one-by-one":
        outputs = [engine.generate([p], params)[0] for p in PROMPTS]
    else:
        engine.generate([PROMPTS[0]], params)  # its blocks are in the prefix cache now
        outputs = engine.generate(PROMPTS, params)
        assert outputs[0].metrics.prefix_hit_tokens == 36  # all but the last token
    for prompt, out in zip(PROMPTS, outputs):
        assert out.token_ids == hf_greedy(tiny_qwen, prompt, 20)


def test_every_layer_full_is_the_paged_cache(tiny_model):
    params = kvlab.SamplingParams(max_new_tokens=16, ignore_eos=True)
    paged = kvlab.Engine(tiny_model, kvlab.EngineConfig(cache="paged", block_size=4))
    engine = checked(kvlab.Engine(tiny_model, hybrid(prefix_caching="hash")))
    assert len(engine.cache.groups) == 1
    assert engine.cache.pool.k.shape == paged.cache.pool.k.shape  # every layer per block
    for prompt in PROMPTS:
        assert engine.generate([prompt], params)[0].token_ids == (
            paged.generate([prompt], params)[0].token_ids
        )


def test_a_sliding_group_frees_the_blocks_that_left_its_window(tiny_qwen):
    engine = checked(kvlab.Engine(tiny_qwen, hybrid()))
    seq_blocks = []
    engine.observers.subscribe(
        "after_step", lambda finished: seq_blocks.append(engine.cache.group_blocks())
    )
    params = kvlab.SamplingParams(max_new_tokens=40, ignore_eos=True)
    out = engine.generate([PROMPTS[0]], params)[0]
    assert out.token_ids == hf_greedy(tiny_qwen, PROMPTS[0], 40)
    full, sliding = seq_blocks[-2]  # the last step that still held the request
    # 37 + 39 tokens: the full group holds them all; the window reaches 7 back from the
    # next token (2 blocks of 4), and the block being written is the third
    assert full == 19 and sliding <= 3
    assert engine.cache.parts[1].dropped_blocks >= 16
    assert engine.cache.allocator.num_used == 0  # all back after the request


def test_the_same_budget_holds_more_tokens_with_sliding_groups(tiny_model):
    """A budget of 64 tokens of both layers' KV: two 40-token requests outgrow it with
    every layer full (one is preempted and recomputed); with the first layer sliding, a
    token holds its window's layer only while in the window, and both run through."""
    prompts = [list(range(300, 330)), list(range(400, 430))]
    params = kvlab.SamplingParams(max_new_tokens=10, ignore_eos=True)
    budget = {"kv_budget_tokens": 64, "max_model_len": 64}
    preempted = {}
    for name, pattern in (("full", None), ("slid", "window=8,full")):
        engine = checked(kvlab.Engine(tiny_model, hybrid(attention_pattern=pattern, **budget)))
        outputs = engine.generate(prompts, params)
        preempted[name] = sum(out.metrics.preemptions for out in outputs)
    assert engine.cache.num_blocks == 32  # a block holds one layer: twice the blocks
    assert preempted["full"] >= 1 and preempted["slid"] == 0


def test_a_dropped_block_stays_cached_and_a_later_prompt_still_hits(tiny_qwen):
    engine = checked(kvlab.Engine(tiny_qwen, hybrid(prefix_caching="hash")))
    params = kvlab.SamplingParams(max_new_tokens=4, ignore_eos=True)
    prompt = PROMPTS[0]  # 37 tokens: the window dropped most of its blocks
    engine.generate([prompt], params)
    # 37 + 3 computed tokens: 10 full blocks in each group, the window's dropped ones too
    assert engine.cache.allocator.num_cached == 10 + 10
    again = engine.generate([prompt + [11, 12]], params)[0]
    assert again.metrics.prefix_hit_tokens == 36
    assert again.token_ids == hf_greedy(tiny_qwen, prompt + [11, 12], 4)


def test_a_hit_the_window_cannot_serve_is_no_hit(tiny_qwen):
    """Its sliding group evicted the prompt's tail blocks: the full group holds all of
    them, but the window cannot read back from the hit, so the prompt runs whole."""
    engine = checked(kvlab.Engine(tiny_qwen, hybrid(prefix_caching="hash")))
    params = kvlab.SamplingParams(max_new_tokens=4, ignore_eos=True)
    prompt = PROMPTS[0]
    engine.generate([prompt], params)
    cache = engine.cache
    sliding = cache.parts[1]
    for block in list(sliding.index.block_of.values()):  # the LRU took the window's blocks
        sliding.sharing.forget(block)
        cache.allocator.uncache(block)
    cache.check_integrity()
    out = engine.generate([prompt], params)[0]
    assert out.metrics.prefix_hit_tokens == 0
    assert out.token_ids == hf_greedy(tiny_qwen, prompt, 4)
    why = engine.explain(out.request_id)  # the group that set the hit, named
    assert "0 of 37 prompt tokens hit" in why and "0 (full) 36, 1 (window 8) 0" in why


@pytest.mark.parametrize("interval, kept", [(None, set(range(10))), (16, {2, 3, 6, 7, 8, 9})])
def test_a_retention_interval_keeps_only_the_blocks_its_hits_read(tiny_qwen, interval, kept):
    """40 computed tokens in blocks of 4, a window of 8 (a hit reads 2 blocks back): with
    an interval of 16 tokens the window keeps cached blocks 2-3 and 6-7 (what hits at
    16 and 32 read) and the blocks it held at the end; without, every block."""
    config = hybrid(prefix_caching="hash", prefix_cache_retention_interval=interval)
    engine = checked(kvlab.Engine(tiny_qwen, config))
    params = kvlab.SamplingParams(max_new_tokens=4, ignore_eos=True)
    out = engine.generate([PROMPTS[0]], params)[0]
    keys = engine.cache.index.keys(PROMPTS[0] + out.token_ids[:3], None)
    sliding = engine.cache.parts[1].index.block_of
    assert {i for i, key in enumerate(keys) if key in sliding} == kept
    assert len(engine.cache.parts[0].index.block_of) == 10  # the full group keeps all
    frame = engine.telemetry.frame()
    assert frame.group_blocks.iloc[0] == (10, 3)  # after the prompt: the window holds 3


def test_a_retention_interval_is_a_multiple_of_the_block():
    for bad in (0, 6):
        with pytest.raises(ValueError, match="prefix_cache_retention_interval"):
            hybrid(prefix_cache_retention_interval=bad)
    with pytest.raises(ValueError, match="needs cache='hybrid'"):
        kvlab.EngineConfig(cache="paged", prefix_cache_retention_interval=16)


def test_kv_events_name_the_group(tiny_qwen):
    log = EventLog()
    engine = kvlab.Engine(tiny_qwen, hybrid(prefix_caching="hash"), kv_events=log)
    engine.generate([PROMPTS[0]], kvlab.SamplingParams(max_new_tokens=2, ignore_eos=True))
    stored = [e for e in log.take() if type(e).__name__ == "BlockStored"]
    assert {e.group_idx for e in stored} == {0, 1}
    hashes = [sorted(h for e in stored if e.group_idx == g for h in e.block_hashes) for g in (0, 1)]
    assert hashes[0] == hashes[1]  # the same chained keys, in each group's index


def test_the_real_model_with_gemmas_pattern_decodes_as_transformers(model, chat_prompts):
    """SmolLM2-135M given 5 sliding layers (32 tokens) to 1 full one: 6 groups of 5 layers,
    a block holds 5 layers, and the tokens are transformers' with that pattern."""
    reference = gemma3_reference(model, 32)
    config = kvlab.EngineConfig(
        cache="hybrid", attention="kernels", attention_pattern="window=32*5,full"
    )
    engine = checked(kvlab.Engine(model, config))
    assert len(engine.cache.groups) == 6 and engine.cache.pool.k.shape[0] == 5
    prompt = model.tokenizer(" ".join(chat_prompts[:12]))["input_ids"]
    assert len(prompt) > 100
    params = kvlab.SamplingParams(max_new_tokens=16, ignore_eos=True)
    assert engine.generate([prompt], params)[0].token_ids == hf_greedy(reference, prompt, 16)


@pytest.mark.parametrize(
    "name, value",
    [("preemption", "swap"), ("prefix_caching", "radix"), ("admission", "reserve"),
     ("speculative", {"method": "ngram", "num_speculative_tokens": 2})],
)  # fmt: skip
def test_the_hybrid_cache_refuses_what_it_does_not_combine_with_yet(tiny_model, name, value):
    with pytest.raises(ValueError, match=name if name != "admission" else "reserve"):
        kvlab.Engine(tiny_model, hybrid(**{name: value}))


def test_a_dropped_entry_reads_nothing(tiny_qwen):
    engine = kvlab.Engine(tiny_qwen, hybrid())
    engine.add_request(PROMPTS[0], kvlab.SamplingParams(max_new_tokens=8, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
        for seq in engine.scheduler.running:
            full, sliding = engine.cache.group_tables(seq)
            assert DROPPED not in full
            kept = [b for b in sliding if b != DROPPED]
            assert not set(kept) & set(full)  # one block, one group
