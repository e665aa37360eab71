"""One regression test per class of defect the engine once had (issue 12), each on a
request mix that reproduced it. `tests/test_engine_fuzz.py` hunts for the rest."""

from __future__ import annotations

import pytest
import torch

import kvlab
from kvlab.cache import KVPool, KVSpec
from kvlab.cache.codecs import CODECS
from kvlab.config import SamplingParams
from kvlab.integrity import IntegrityError

GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)


def _engine(model, **config) -> kvlab.Engine:
    return kvlab.Engine(model, kvlab.EngineConfig(max_model_len=128, **config))


def _drain(engine: kvlab.Engine, limit: int = 2_000) -> None:
    """Step until done, checking every invariant after every step; a stall fails."""
    for _ in range(limit):
        if not engine.has_unfinished():
            return
        rows = len(engine.telemetry.records)
        engine.step()
        engine.cache.check_integrity()
        assert len(engine.telemetry.records) > rows, "work is queued but nothing ran"
    raise AssertionError(f"not finished after {limit} steps: the engine is livelocked")


def _solo(model, prompt: list[int], params: SamplingParams = GREEDY, **config) -> list[int]:
    engine = _engine(model, kv_budget_tokens=128, **config)
    return engine.generate([prompt], params)[0].token_ids


def _prompt(n: int, start: int = 0) -> list[int]:
    return [11 + (start + 31 * j) % 30000 for j in range(n)]


def _tokens(engine: kvlab.Engine) -> dict[int, list[list[int]]]:
    return {o.request_id: [s.token_ids for s in o.samples] for o in engine.finished}


# 1. Chunked prefill, prefill-first: one token left to compute, scheduled twice ----------
@pytest.mark.parametrize("cache", ["naive", "paged"])
def test_a_one_token_prompt_is_scheduled_once_per_step(tiny_model, cache):
    extra = dict(block_size=1) if cache == "paged" else {}
    engine = _engine(tiny_model, cache=cache, chunked_prefill=True, kv_budget_tokens=256, **extra)
    long_id = engine.add_request(_prompt(40), GREEDY)
    engine.step()  # the long prompt is part-way in
    short_id = engine.add_request([7], GREEDY)
    _drain(engine)
    assert _tokens(engine)[short_id] == [_solo(tiny_model, [7])]
    assert _tokens(engine)[long_id] == [_solo(tiny_model, _prompt(40))]


def test_a_prefix_hit_leaving_one_token_is_scheduled_once(tiny_model):
    engine = _engine(
        tiny_model, cache="paged", prefix_caching="hash", chunked_prefill=True,
        kv_budget_tokens=256,
    )  # fmt: skip
    prompt = _prompt(33)  # two full blocks of 16, then one token
    engine.generate([prompt], GREEDY)
    again = engine.add_request(prompt, GREEDY)
    _drain(engine)
    out = next(o for o in engine.finished if o.request_id == again)
    assert out.metrics.prefix_hit_tokens == 32
    assert out.token_ids == _solo(tiny_model, prompt)


# 2. Reserve admission and n > 1 ------------------------------------------------------------
def test_reserve_admission_counts_every_sample(tiny_model):
    params = SamplingParams(max_new_tokens=20, n=3, ignore_eos=True)
    prompt = _prompt(20)  # 2 blocks of 16, the second shared and partly filled
    # Worst case: 3 blocks for the first sample, 3 - 1 shared + 1 copy for each other one.
    engine = _engine(tiny_model, cache="paged", admission="reserve", kv_budget_tokens=16 * 8)
    engine.add_request(prompt, params)
    engine.add_request(_prompt(20, 5), SamplingParams(max_new_tokens=20, ignore_eos=True))
    _drain(engine)
    assert engine.scheduler.preemptions == 0  # reserve admission never preempts
    assert engine.cache.allocator.num_used == 0


def test_a_group_too_big_for_reserve_admission_is_rejected(tiny_model):
    engine = _engine(tiny_model, cache="paged", admission="reserve", kv_budget_tokens=16 * 6)
    with pytest.raises(ValueError, match="n=3 needs 8 blocks .* only 6 blocks"):
        engine.add_request(_prompt(20), SamplingParams(max_new_tokens=20, n=3))
    assert not engine.has_unfinished()


# 3. Static batching + swap ----------------------------------------------------------------
def test_static_batching_resumes_swapped_requests(tiny_model):
    engine = _engine(
        tiny_model, cache="paged", block_size=4, admission="watermark", watermark=0.0,
        preemption="swap", batching="static", kv_budget_tokens=4 * 12,
    )  # fmt: skip
    prompts = [_prompt(10, i) for i in range(3)]
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_new_tokens=20, ignore_eos=True))
    _drain(engine)
    assert engine.scheduler.swapped_bytes > 0
    long = SamplingParams(max_new_tokens=20, ignore_eos=True)
    assert list(_tokens(engine).values()) == [[_solo(tiny_model, p, long)] for p in prompts]


# 4. kivi2 block copies outside the forward -----------------------------------------------
@pytest.mark.parametrize(
    "config",
    [
        dict(prefix_caching="radix"),  # partial-block hits
        dict(admission="watermark", preemption="swap", kv_budget_tokens=16 * 5),
    ],
    ids=["radix-partial-hit", "swap"],
)
def test_kivi2_copies_blocks_outside_the_forward(tiny_model, config):
    base = dict(cache="paged", kv_codec="kivi2", kv_budget_tokens=16 * 16)
    engine = _engine(tiny_model, **(base | config))
    engine.add_request(_prompt(40), SamplingParams(max_new_tokens=20, n=3, ignore_eos=True))
    _drain(engine)
    for i in range(3):
        engine.add_request(_prompt(36) + [5 + i], GREEDY)  # 36 of 40 tokens shared
    _drain(engine)
    assert len(engine.finished) == 4
    assert engine.cache.copied_blocks > 0


@pytest.mark.parametrize("kv_codec", [None, *CODECS.names()])
def test_block_copies_are_bit_exact_for_every_codec(kv_codec):
    """Copy-on-write, swap and partial hits move stored codes, never decode + re-encode."""
    torch.manual_seed(0)
    spec, g = KVSpec(2, 2, 64), 16
    pool = KVPool(spec, 8 * g, torch.float32, torch.device("cpu"), kv_codec)
    with torch.inference_mode():
        for layer in range(spec.num_layers):
            k, v = (torch.randn(g + 5, 2, 64) * 3 for _ in range(2))
            pool.write(layer, torch.arange(g), k[:g], v[:g])  # a whole group
            for i in range(5):  # then 5 tokens one by one: an incomplete group
                slot = torch.tensor([g + i])
                pool.write(layer, slot, k[g + i : g + i + 1], v[g + i : g + i + 1])
    source, target = torch.arange(g + 5), torch.arange(4 * g, 5 * g + 5)
    pool.copy(source, target)
    saved = pool.read(source)
    pool.restore(torch.arange(6 * g, 7 * g + 5), saved)
    for layer in range(spec.num_layers):
        original = pool.gather(layer, source[None])
        for copy in (target, torch.arange(6 * g, 7 * g + 5)):
            copied = pool.gather(layer, copy[None])
            for a, b in zip(original, copied):
                assert torch.equal(a.view(torch.int32), b.view(torch.int32))  # bits
    again = pool.read(target)
    for name, tensor in saved.tensors.items():  # bits: the scales of an incomplete group
        # are never written (torch.empty), and garbage may be NaN, which equals nothing
        bits = (t.contiguous().view(torch.uint8) for t in (tensor, again.tensors[name]))
        assert torch.equal(*bits), name


# 5. Watermark admission of a prompt bigger than 1 - watermark of the pool -------------------
def test_watermark_admits_a_big_prompt_when_nothing_else_runs(tiny_model):
    engine = _engine(
        tiny_model, cache="paged", block_size=8, admission="watermark", watermark=0.5,
        kv_budget_tokens=8 * 10,
    )  # fmt: skip
    prompt = _prompt(60)  # 8 of 10 blocks: more than the 5 the watermark leaves
    engine.add_request(prompt, GREEDY)
    _drain(engine)
    assert engine.finished[0].token_ids == _solo(tiny_model, prompt)


# 6. A radix partial hit on the last block the pool can hand out -----------------------------
def test_partial_hit_on_the_last_available_block_recomputes_instead(tiny_model):
    engine = _engine(
        tiny_model, cache="paged", prefix_caching="radix", admission="watermark",
        kv_budget_tokens=16 * 2,
    )  # fmt: skip
    first = _prompt(20)
    engine.generate([first], SamplingParams(max_new_tokens=1))
    assert engine.cache.allocator.num_cached == 2  # a full block and a partial one
    second = first[:18] + [3, 4]  # 16 + 2 tokens match, but the copy has no block to land in
    engine.add_request(second, SamplingParams(max_new_tokens=1))
    _drain(engine)
    assert engine.finished[-1].metrics.prefix_hit_tokens == 16
    assert engine.finished[-1].token_ids == _solo(tiny_model, second, SamplingParams(1))


# 6b. Blocks shared in the step that computes them (issue 14: sharing as vLLM V1) ------------
@pytest.mark.parametrize("kv_codec", [None, "fp8_e4m3"])
def test_a_block_shared_before_it_is_computed_is_written_in_place(tiny_model, kv_codec):
    # Shrunk from the state machine: the second request shares the first's block of token
    # 5 in the step that computes it. Copy-on-write for the first writer would leave the
    # shared block unwritten (NaN garbage read by the second; fp8 refuses to store it).
    config = dict(
        cache="paged", block_size=1, prefix_caching="radix", kv_codec=kv_codec,
        kv_budget_tokens=96, admission="watermark", watermark=0.0,
    )  # fmt: skip
    engine = _engine(tiny_model, **config)
    first, second = [5, 1], [5, *range(12, 118, 7)]
    engine.add_request(first, SamplingParams(max_new_tokens=1))
    engine.add_request(second, SamplingParams(max_new_tokens=1))
    engine.step()
    engine.cache.check_integrity()
    assert engine.cache.copied_blocks == 0
    _drain(engine)
    out = {o.request_id: o for o in engine.finished}
    assert out[1].metrics.prefix_hit_tokens == 1
    assert out[1].token_ids == _solo(tiny_model, second, SamplingParams(1), kv_codec=kv_codec)


# 7. Seats, token budget, phase labels, salts ------------------------------------------------
def test_forks_count_against_max_num_seqs(tiny_model):
    engine = _engine(tiny_model, cache="paged", max_num_seqs=3, kv_budget_tokens=1024)
    for i in range(3):
        engine.add_request(_prompt(10, i), SamplingParams(max_new_tokens=8, n=2))
    seen = 0
    while engine.has_unfinished():
        engine.step()
        seen = max(seen, len(engine.scheduler.running))
    assert seen <= 3
    with pytest.raises(ValueError, match="n=4 .*max_num_seqs=3"):
        engine.add_request([1, 2], SamplingParams(n=4))


def test_decode_steps_stay_within_the_token_budget(tiny_model):
    engine = _engine(tiny_model, cache="paged", max_num_batched_tokens=3, kv_budget_tokens=1024)
    engine.generate([_prompt(2, i) for i in range(5)], GREEDY)
    assert (engine.stats()["tokens"] <= 3).all()


def test_one_token_prompts_are_labelled_prefill(tiny_model):
    engine = _engine(tiny_model, cache="paged", kv_budget_tokens=1024)
    engine.generate([[5], [6]], SamplingParams(max_new_tokens=3))
    assert engine.stats()["phase"].tolist() == ["prefill", "decode", "decode"]


def test_a_non_string_salt_is_rejected_before_queueing(tiny_model):
    engine = _engine(tiny_model, cache="paged", prefix_caching="hash", kv_budget_tokens=1024)
    ok = engine.add_request([1, 2, 3], GREEDY)
    with pytest.raises(ValueError, match="salt=7 must be a string or None"):
        engine.add_request([1, 2, 3], GREEDY, salt=7)
    _drain(engine)
    assert [o.request_id for o in engine.finished] == [ok]


# Invariant checks raise a named error, even under python -O --------------------------------
def test_a_broken_invariant_raises_integrity_error(tiny_model):
    engine = _engine(tiny_model, cache="paged", kv_budget_tokens=1024)
    engine.add_request(_prompt(20), GREEDY)
    engine.step()
    engine.cache.allocator.ref_counts[engine.cache.block_table(engine.scheduler.running[0])[0]] += 1
    with pytest.raises(IntegrityError, match="reference counts != table references"):
        engine.cache.check_integrity()
