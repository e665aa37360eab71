"""A request whose forward or sampling raises fails alone (kvlab.engine.isolation): it
finishes with finish_reason "error" and the message, every other request finishes
token-identical to its solo run, and no block is left in use. A dead worker process
(EngineDead) is never isolated."""

from __future__ import annotations

import pytest

import kvlab
import kvlab.engine.postprocess as engine_module
from kvlab.config import SamplingParams
from kvlab.integrity import EngineDead, IntegrityError

SENTINEL = 4242  # a token only the poisoned prompt holds
SHARED = list(range(300, 332))  # two blocks of 16 the burst shares
GOOD = [SHARED + [11, 12, 13], SHARED + [21, 22], list(range(500, 509)), [7, 8, 9, 10]]
POISONED = SHARED + [SENTINEL, 5]
PARAMS = SamplingParams(max_new_tokens=8, ignore_eos=True)
CONFIGS = {
    "paged+prefix": dict(cache="paged", prefix_caching="hash"),
    "chunked+radix": dict(
        cache="paged", prefix_caching="radix", chunked_prefill=True, max_num_batched_tokens=24
    ),  # fmt: skip
    "speculative": dict(cache="paged", speculative={"method": "ngram"}),
    "naive": dict(cache="naive"),
}


class Injected(RuntimeError):
    pass


def _engine(model, **config) -> kvlab.Engine:
    return kvlab.Engine(model, kvlab.EngineConfig(max_model_len=128, kv_budget_tokens=1024,
                                                  **config))  # fmt: skip


def _poison(stage: str, engine, monkeypatch) -> None:
    if stage == "forward":
        forward = engine.runner.forward

        def failing(input_ids, *args, **kwargs):
            if (input_ids == SENTINEL).any():
                raise Injected("the forward broke")
            return forward(input_ids, *args, **kwargs)

        monkeypatch.setattr(engine.runner, "forward", failing)
    else:
        sample = engine_module.sample

        def failing_sample(logits, seqs):
            if any(SENTINEL in s.prompt_ids for s in seqs):
                raise Injected("sampling broke")
            return sample(logits, seqs)

        monkeypatch.setattr(engine_module, "sample", failing_sample)


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("stage", ["forward", "sampling"])
@pytest.mark.parametrize("first", [0, 2], ids=["publishes", "shares"])
def test_a_failing_request_fails_alone(tiny_model, stage, config, first, monkeypatch):
    """All arrive for one step; the poisoned one is admitted first (the others share the
    prefix blocks it was to write) or after two that publish them."""
    solo = _engine(tiny_model, cache="paged")
    expected = [solo.generate([p], PARAMS)[0].token_ids for p in GOOD]
    engine = _engine(tiny_model, **CONFIGS[config])
    _poison(stage, engine, monkeypatch)
    ids = [engine.add_request(p, PARAMS) for p in GOOD[:first]]
    bad = engine.add_request(POISONED, PARAMS)
    ids += [engine.add_request(p, PARAMS) for p in GOOD[first:]]
    while engine.has_unfinished():
        engine.step()
        engine.cache.check_integrity()
    outputs = {o.request_id: o for o in engine.finished}
    assert outputs[bad].finish_reason == "error"
    assert f"Injected: {'the forward broke' if stage == 'forward' else 'sampling broke'}" in (
        outputs[bad].error
    )
    assert [outputs[i].token_ids for i in ids] == expected
    assert all(outputs[i].error is None for i in ids)
    held = engine.cache.allocator.num_used if config != "naive" else len(engine.cache.region_of)
    assert held == 0


def test_a_failing_sample_of_n_fails_its_whole_request(tiny_model, monkeypatch):
    engine = _engine(tiny_model, cache="paged", prefix_caching="hash")
    _poison("sampling", engine, monkeypatch)
    good = engine.add_request(GOOD[2], SamplingParams(max_new_tokens=6, n=2, temperature=1.0,
                                                      seed=3))  # fmt: skip
    bad = engine.add_request(POISONED, SamplingParams(max_new_tokens=6, n=3))
    while engine.has_unfinished():
        engine.step()
    outputs = {o.request_id: o for o in engine.finished}
    assert outputs[bad].finish_reason == "error" and len(outputs[good].samples) == 2
    assert engine.cache.allocator.num_used == 0


@pytest.mark.parametrize("config", ["naive", "speculative"])
def test_a_step_whose_only_request_fails_goes_on(tiny_model, config, monkeypatch):
    """Every row of the batch failed: nothing is left to post-process (found by the fuzz
    soak: the empty batch's sampling indexed a logits list with no rows)."""
    engine = _engine(tiny_model, **CONFIGS[config])
    _poison("forward", engine, monkeypatch)
    bad = engine.add_request(POISONED, PARAMS)
    finished = engine.step()
    assert [(o.request_id, o.finish_reason) for o in finished] == [(bad, "error")]
    good = engine.add_request(GOOD[3], PARAMS)
    while engine.has_unfinished():
        engine.step()
    assert engine.finished[-1].request_id == good and engine.finished[-1].error is None


@pytest.mark.parametrize("error", [EngineDead("rank 1 (pid 7) died"), IntegrityError("rank 1")])
def test_a_dead_worker_or_a_broken_invariant_is_not_isolated(tiny_model, error, monkeypatch):
    """Neither is one request's fault: the step raises, nothing fails quietly."""
    engine = _engine(tiny_model, cache="paged")

    def dead(*args, **kwargs):
        raise error

    monkeypatch.setattr(engine.runner, "forward", dead)
    engine.add_request(GOOD[0], PARAMS)
    engine.add_request(GOOD[1], PARAMS)
    with pytest.raises(type(error), match="rank 1"):
        engine.step()
