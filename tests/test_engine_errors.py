"""Bad input gets a ValueError naming the limit, before any work, and nothing is lost."""

from __future__ import annotations

import pytest
from conftest import small_engine

import kvlab
from kvlab.build import check_config


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: kvlab.SamplingParams(max_new_tokens=0), "max_new_tokens=0 must be >= 1"),
        (lambda: kvlab.SamplingParams(max_new_tokens=-3), "max_new_tokens=-3"),
        (lambda: kvlab.SamplingParams(top_p=0), "top_p=0"),
        (lambda: check_config(kvlab.EngineConfig(cache="bogus")), "cache='bogus' is unknown"),
        (lambda: kvlab.EngineConfig(kv_budget_tokens=0), "kv_budget_tokens=0 must be > 0"),
        (lambda: kvlab.EngineConfig(kv_budget_tokens=8, kv_budget_bytes=8), "not both"),
    ],
)
def test_config_errors_name_the_field(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_budget_too_small_for_one_sequence(model):
    with pytest.raises(ValueError, match="max_model_len=512"):
        small_engine(model, kv_budget_tokens=511)
    with pytest.raises(ValueError, match="too small"):
        small_engine(model, kv_budget_tokens=None, kv_budget_bytes=1000)


def test_max_model_len_beyond_the_model(model):
    with pytest.raises(ValueError, match="exceeds the model's 8192"):
        small_engine(model, max_model_len=10_000)


def test_bad_requests_are_rejected_and_others_keep_running(model, chat_prompts):
    engine = small_engine(model)
    params = kvlab.SamplingParams(max_new_tokens=8)
    good = [engine.add_request(p, params) for p in chat_prompts[:3]]
    engine.step()  # the good requests are now running
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request("", params)
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request([], params)
    with pytest.raises(ValueError, match="max_model_len=512"):
        engine.add_request("word " * 600, params)
    with pytest.raises(ValueError, match=r"\[0, 49152\)"):
        engine.add_request([1, 2, 49152], params)
    with pytest.raises(ValueError, match="empty"):
        engine.generate(["fine prompt", ""], params)  # validated before anything is queued
    assert len(engine.scheduler.waiting) + len(engine.scheduler.running) == 3

    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] = out
    assert sorted(done) == good
    assert all(len(out.token_ids) >= 1 for out in done.values())
    engine.cache.check_integrity()
    memory = engine.cache.memory()
    assert memory.reserved_bytes == 0 and memory.live_bytes == 0
    assert len(engine.cache.free_regions) == engine.cache.num_blocks


def test_generate_rejects_a_bare_string(model):
    with pytest.raises(TypeError, match="list of prompts"):
        small_engine(model).generate("hello")
