"""Every prefix miss and every preemption carries its reason (`engine.explain`): each one
built on purpose here, and its label checked."""

from __future__ import annotations

import pytest

import kvlab
from kvlab.config import SamplingParams

ONE = SamplingParams(max_new_tokens=1)


def _engine(model, **config) -> kvlab.Engine:
    settings = dict(cache="paged", prefix_caching="hash", max_model_len=128)
    return kvlab.Engine(model, kvlab.EngineConfig(**(settings | config)))


def _prompt(n: int, start: int = 0) -> list[int]:
    return [11 + (start + 31 * j) % 30000 for j in range(n)]


def _serve(engine: kvlab.Engine, prompt: list[int], **request) -> kvlab.RequestOutput:
    rid = engine.add_request(prompt, ONE, **request)
    while engine.has_unfinished():
        engine.step()
    engine.cache.check_integrity()
    return next(o for o in engine.finished if o.request_id == rid)


def _label(out: kvlab.RequestOutput) -> str:
    (note,) = [n for n in out.notes if n.kind == "prefix"]
    return note.label


def test_a_first_request_was_never_seen_and_its_repeat_hits(tiny_model):
    engine = _engine(tiny_model)
    first = _serve(engine, _prompt(33))
    assert _label(first) == "never seen"
    again = _serve(engine, _prompt(33))
    assert _label(again) == "hit" and again.metrics.prefix_hit_tokens == 32
    assert "32 of 33 prompt tokens hit" in engine.explain(again.request_id)


def test_a_prompt_shorter_than_one_block_never_hits(tiny_model):
    engine = _engine(tiny_model)
    _serve(engine, _prompt(10))
    out = _serve(engine, _prompt(10))
    assert out.metrics.prefix_hit_tokens == 0 and _label(out) == "shorter than one block"
    assert "last token is always computed" in engine.explain(out.request_id)


def test_hash_shares_no_partial_block(tiny_model):
    engine = _engine(tiny_model)
    _serve(engine, _prompt(40))
    out = _serve(engine, _prompt(40))
    assert out.metrics.prefix_hit_tokens == 32 and _label(out) == "partial block"
    assert "missed from block 2 on" in engine.explain(out.request_id)


def test_another_salt_misses_with_that_reason(tiny_model):
    engine = _engine(tiny_model)
    _serve(engine, _prompt(40), salt="tenant-a")
    out = _serve(engine, _prompt(40), salt="tenant-b")
    assert out.metrics.prefix_hit_tokens == 0 and _label(out) == "different salt"


def test_an_evicted_prefix_says_so(tiny_model):
    engine = _engine(tiny_model, kv_budget_tokens=16 * 4)
    _serve(engine, _prompt(40))  # its three blocks stay cached...
    _serve(engine, _prompt(40, start=7))  # ...until this one needs all but one of the four
    assert engine.cache.allocator.evictions > 0  # tails go first: block 0 survives
    out = _serve(engine, _prompt(40))
    assert out.metrics.prefix_hit_tokens == 16 and _label(out) == "evicted"
    assert "missed from block 1 on: evicted" in engine.explain(out.request_id)


def test_a_partial_copy_from_a_block_computed_in_the_same_step_is_refused(tiny_model):
    engine = _engine(tiny_model, prefix_caching="radix")
    first = _prompt(40)
    a = engine.add_request(first, ONE)
    b = engine.add_request(first[:20] + _prompt(10, start=3), ONE)
    while engine.has_unfinished():
        engine.step()
    out = {o.request_id: o for o in engine.finished}
    assert out[b].metrics.prefix_hit_tokens == 16  # block 0 shared in the step it is computed
    assert _label(out[a]) == "never seen" and _label(out[b]) == "computed in the same step"


def test_a_partial_match_with_no_block_to_copy_into_is_recomputed(tiny_model):
    engine = _engine(tiny_model, prefix_caching="radix", admission="watermark", kv_budget_tokens=32)
    first = _prompt(20)
    _serve(engine, first)
    out = _serve(engine, first[:18] + [3, 4])
    assert out.metrics.prefix_hit_tokens == 16 and _label(out) == "no room to copy"


def test_every_preemption_names_who_needed_blocks_and_the_victim_rule(tiny_model):
    engine = _engine(
        tiny_model, prefix_caching=None, admission="watermark", watermark=0.0,
        kv_budget_tokens=16 * 6,
    )  # fmt: skip
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    ids = [engine.add_request(_prompt(20, start=i), params) for i in range(3)]
    while engine.has_unfinished():
        engine.step()
    engine.cache.check_integrity()
    assert engine.scheduler.preemptions > 0
    notes = [n for o in engine.finished for n in o.notes]
    assert len(notes) == engine.scheduler.preemptions
    assert {n.label for n in notes} == {"out of blocks"}
    text = "\n".join(engine.explain(i) for i in ids)
    assert "block(s) for its next 1 token(s)" in text and "victim rule" in text


def test_a_preemption_by_hand_and_an_unknown_request(tiny_model):
    engine = _engine(tiny_model, prefix_caching=None)
    rid = engine.add_request(_prompt(20), SamplingParams(max_new_tokens=4))
    engine.step()
    engine.scheduler.preempt(engine.scheduler.running[0])
    assert "by a call to Scheduler.preempt" in engine.explain(rid)
    assert engine.explain(rid).count("\n") == 0
    with pytest.raises(ValueError, match="request_id=99"):
        engine.explain(99)
