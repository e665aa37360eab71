"""The scheduler under pressure: preemption, chunked prefill, priorities, cancellation."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvlab
from kvlab.config import SamplingParams

PRESSURED = dict(cache="paged", block_size=8, admission="watermark", max_model_len=512)


def _prompts(model, n: int, length: int) -> list[list[int]]:
    """n distinct token-id prompts of `length` tokens (no shared prefix)."""
    return [[1 + (i * 7919 + j * 104729) % 40000 for j in range(length)] for i in range(n)]


def _drain(engine, limit: int = 10_000) -> int:
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        engine.cache.check_integrity()
        assert steps < limit, "no progress: the scheduler is livelocked"
    return steps


PARAMS = SamplingParams(max_new_tokens=24, ignore_eos=True)


def _calm(model, prompts, chat: bool) -> tuple[list[list[int]], int]:
    """`prompts` served calmly on the naive cache: their tokens and total KV demand."""
    calm = kvlab.Engine(model, kvlab.EngineConfig(cache="naive", max_model_len=512))
    expected = [o.token_ids for o in calm.generate(prompts, PARAMS, chat=chat)]
    return expected, sum(len(o.prompt_token_ids) + PARAMS.max_new_tokens for o in calm.finished)


def _oversubscribed(model, prompts, mode: str, chunked: bool, chat: bool, calm=None):
    """Serve `prompts` calmly on the naive cache (or take `calm`: _calm's result), then
    paged with a KV budget a quarter of their total demand."""
    expected, demand = calm or _calm(model, prompts, chat)
    budget = 8 * (demand // 4 // 8)  # total KV demand is four times the budget
    engine = kvlab.Engine(
        model,
        kvlab.EngineConfig(
            **PRESSURED,
            kv_budget_tokens=budget,
            preemption=mode,
            chunked_prefill=chunked,
            max_num_batched_tokens=64,
        ),
    )
    outputs = engine.generate(prompts, PARAMS, chat=chat)
    assert [o.token_ids for o in outputs] == expected  # every request, token for token
    stats = engine.stats()
    assert stats["preemptions"].iloc[-1] > 0
    moved = "swapped_bytes" if mode == "swap" else "recomputed_tokens"
    assert stats[moved].iloc[-1] > 0
    assert sum(o.metrics.preemptions for o in outputs) == stats["preemptions"].iloc[-1]
    assert engine.cache.num_available == engine.cache.num_blocks  # budget fully free
    engine.cache.check_integrity()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("chunked", [False, True])
def test_four_times_oversubscribed_completes_identically(tiny_model, mode, chunked):
    _oversubscribed(tiny_model, _prompts(tiny_model, 8, 40), mode, chunked, chat=False)


@pytest.fixture(scope="module")
def calm_chat(model, chat_prompts):
    return _calm(model, chat_prompts[:6], chat=True)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_oversubscribed_real_model_matches_unpressured(model, chat_prompts, calm_chat, mode):
    _oversubscribed(model, chat_prompts[:6], mode, mode == "swap", chat=True, calm=calm_chat)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_two_long_requests_that_evict_each_other_still_progress(tiny_model, mode):
    engine = kvlab.Engine(
        tiny_model,
        kvlab.EngineConfig(**PRESSURED, kv_budget_tokens=96, preemption=mode, watermark=0.0),
    )
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    for prompt in _prompts(tiny_model, 2, 40):  # each needs 80 of the 96 slots
        engine.add_request(prompt, params)
    steps = _drain(engine, limit=400)
    assert len(engine.finished) == 2 and steps < 400
    assert engine.stats()["preemptions"].iloc[-1] >= 1


def test_a_request_that_cannot_fit_even_alone_is_rejected(tiny_model):
    engine = kvlab.Engine(tiny_model, kvlab.EngineConfig(**PRESSURED, kv_budget_tokens=64))
    with pytest.raises(ValueError, match="only 8 blocks"):
        engine.add_request(_prompts(tiny_model, 1, 40)[0], SamplingParams(max_new_tokens=40))
    assert not engine.has_unfinished()


def test_victim_is_lowest_priority_then_most_recent(tiny_model):
    engine = kvlab.Engine(
        tiny_model, kvlab.EngineConfig(**PRESSURED, kv_budget_tokens=128, watermark=0.0)
    )
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    prompts = _prompts(tiny_model, 3, 24)
    vip = engine.add_request(prompts[0], params, priority=1)
    low_old = engine.add_request(prompts[1], params)
    low_new = engine.add_request(prompts[2], params)
    _drain(engine)
    preempted = [e.request_id for e in engine.scheduler.events if e.state == "preempted"]
    assert preempted and vip not in preempted
    assert preempted[0] == low_new and low_old in {e.request_id for e in engine.scheduler.events}


def test_cancel_mid_decode_frees_blocks_at_once(tiny_model):
    engine = kvlab.Engine(
        tiny_model, kvlab.EngineConfig(**PRESSURED, kv_budget_tokens=256, prefix_caching="hash")
    )
    params = SamplingParams(max_new_tokens=50, ignore_eos=True)
    keep, drop = (engine.add_request(p, params) for p in _prompts(tiny_model, 2, 30))
    for _ in range(5):
        engine.step()
    used = engine.cache.allocator.num_used
    assert engine.cancel(drop)
    assert engine.cache.allocator.num_used < used
    assert engine.cache.allocator.num_cached > 0  # its full blocks stay cached (LRU pool)
    assert not engine.cancel(12345)
    _drain(engine)
    reasons = {o.request_id: o.finish_reason for o in engine.finished}
    assert reasons == {keep: "length", drop: "cancelled"}
    assert engine.cache.allocator.num_used == 0


def test_decode_first_chunked_prefill_keeps_decodes_flowing(tiny_model):
    config = dict(
        **PRESSURED, kv_budget_tokens=2048, chunked_prefill=True, max_num_batched_tokens=32
    )
    engine = kvlab.Engine(tiny_model, kvlab.EngineConfig(**config, schedule_order="decode-first"))
    short, long_prompt = _prompts(tiny_model, 2, 200)
    engine.add_request(short[:10], SamplingParams(max_new_tokens=30, ignore_eos=True))
    engine.step()
    engine.step()  # the short request is decoding now
    engine.add_request(long_prompt, SamplingParams(max_new_tokens=2, ignore_eos=True))
    _drain(engine)
    stats = engine.stats()
    mixed = stats[stats["phase"] == "mixed"]
    assert len(mixed) >= 200 // 32  # the long prompt went in chunks beside the decodes
    assert (stats["tokens"] <= 32).all()


@settings(max_examples=25, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["add", "step", "step", "step", "cancel"]), st.integers(0, 10**6)
        ),
        min_size=5,
        max_size=80,
    ),
    mode=st.sampled_from(["recompute", "swap"]),
    chunked=st.booleans(),
    prefix=st.sampled_from([None, "hash", "radix"]),
)
def test_random_arrivals_and_cancellations_keep_integrity(tiny_model, ops, mode, chunked, prefix):
    engine = kvlab.Engine(
        tiny_model,
        kvlab.EngineConfig(
            **PRESSURED,
            kv_budget_tokens=160,
            preemption=mode,
            chunked_prefill=chunked,
            prefix_caching=prefix,
            max_num_batched_tokens=48,
            watermark=0.05,
        ),
    )
    ids = []
    for op, r in ops:
        if op == "add":
            prompt = [1 + (r + j) % 97 for j in range(4 + r % 40)]
            params = SamplingParams(max_new_tokens=1 + r % 30, ignore_eos=True)
            ids.append(engine.add_request(prompt, params, priority=r % 3, salt=str(r % 2)))
        elif op == "cancel" and ids:
            engine.cancel(ids[r % len(ids)])
        else:
            engine.step()
        engine.cache.check_integrity()
    _drain(engine)
    assert {o.request_id for o in engine.finished} == set(ids)
    assert engine.cache.allocator.num_used == 0
