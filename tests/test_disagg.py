"""Disaggregated prefill/decode as two processes (one or a pool of decode engines): identical
tokens, exact bytes, no leaked blocks, bad KV caught."""

from __future__ import annotations

import pytest

import kvlab
from kvlab import EngineConfig, SamplingParams
from kvlab.disagg import Disaggregated

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], list(range(100, 140)), [3, 1, 4, 1, 5, 9, 2, 6], [42] * 21]
CONFIG = dict(cache="paged", block_size=4, max_model_len=256)


def reference(model, params, **config):
    engine = kvlab.Engine(model, EngineConfig(**CONFIG, **config))
    return [o.token_ids for o in engine.generate(PROMPTS, params)]


@pytest.mark.parametrize(
    "fault, decode_engines", [(None, 1), (None, 2), ("corrupt", 2), ("truncate", 1)]
)
def test_tokens_equal_one_engine(tiny_model, fault, decode_engines):
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    pair = Disaggregated(tiny_model, EngineConfig(**CONFIG), EngineConfig(**CONFIG), fault=fault,
                         decode_engines=decode_engines)  # fmt: skip
    try:
        outs = pair.generate(PROMPTS, params)
    finally:
        pair.close()
    assert [o.token_ids for o in outs] == reference(tiny_model, params)
    assert len(pair.decodes) == decode_engines and pair.prefill_blocks_held == 0
    for engine, consumer in zip(pair.decodes, pair.consumers, strict=True):
        engine.cache.check_integrity()
        assert engine.cache.num_available == engine.cache.num_blocks  # no block leaked
        assert not consumer.arrived  # every intact transfer loaded
        consumer.check_integrity()
    stats = pair.stats
    assert stats.transfers == len(PROMPTS) and sum(stats.routed) == len(PROMPTS)
    if decode_engines > 1:
        assert min(stats.routed) >= 1  # least-loaded: an idle engine takes the next request
    decode = pair.decode.cache
    if fault is None:
        assert stats.rejected == 0
        prompt_kv = sum(len(p) for p in PROMPTS) * decode.pool.bytes_per_token
        assert stats.bytes_moved == prompt_kv  # exactly the prompts' KV, nothing more
        assert stats.bytes_moved == stats.prompt_tokens * decode.pool.bytes_per_token
        loaded = [c.stats for c in pair.consumers]  # through the consumers, layer by layer
        assert sum(s.requests for s in loaded) == len(PROMPTS)
        assert sum(sum(s.layer_bytes) for s in loaded) == prompt_kv
    else:
        assert stats.rejected == len(PROMPTS)  # every spoiled transfer recomputed


def test_prefill_time_counts_each_step_once(tiny_model):
    """The four prompts are prefilled in one step, which finishes all four: its wall time
    counts once in PairStats.prefill_s (it was counted once per finished request)."""
    pair = Disaggregated(tiny_model, EngineConfig(**CONFIG), EngineConfig(**CONFIG))
    try:
        pair.generate(PROMPTS, SamplingParams(max_new_tokens=2, ignore_eos=True))
        pair.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2, ignore_eos=True))
    finally:
        pair.close()
    record, stats = pair.prefill_record, pair.stats  # record: the prefill engine's telemetry
    assert stats.transfers == len(PROMPTS) + 1
    assert stats.prefill_steps == record["steps"] == 2  # one step per generate call
    assert stats.prefill_s == pytest.approx(record["step_s"]) and stats.prefill_s > 0


@pytest.mark.parametrize("decode_engines", [0, -1, 1.5, True, "2"])
def test_bad_pool_size_is_refused(tiny_model, decode_engines):
    with pytest.raises(ValueError, match="decode_engines"):
        Disaggregated(tiny_model, EngineConfig(**CONFIG), EngineConfig(**CONFIG),
                      decode_engines=decode_engines)  # fmt: skip


def test_int8_kv_moves_as_stored(tiny_model):
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    config = EngineConfig(**CONFIG, kv_codec="int8")
    pair = Disaggregated(tiny_model, config, config)
    try:
        outs = pair.generate(PROMPTS, params)
    finally:
        pair.close()
    assert [o.token_ids for o in outs] == reference(tiny_model, params, kv_codec="int8")
    assert pair.stats.rejected == 0


def test_mismatched_codecs_and_naive_decode_are_refused(tiny_model):
    with pytest.raises(ValueError, match="kv_codec"):
        Disaggregated(tiny_model, EngineConfig(**CONFIG, kv_codec="int8"), EngineConfig(**CONFIG))
    with pytest.raises(ValueError, match="does not swap"):
        Disaggregated(tiny_model, EngineConfig(**CONFIG), EngineConfig(max_model_len=256))
