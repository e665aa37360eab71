"""Disaggregated prefill/decode as two processes: identical tokens, exact bytes, bad KV caught."""

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


@pytest.mark.parametrize("fault", [None, "corrupt", "truncate"])
def test_tokens_equal_one_engine(tiny_model, fault):
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    pair = Disaggregated(tiny_model, EngineConfig(**CONFIG), EngineConfig(**CONFIG), fault=fault)
    try:
        outs = pair.generate(PROMPTS, params)
    finally:
        pair.close()
    assert [o.token_ids for o in outs] == reference(tiny_model, params)
    decode = pair.decode.cache
    decode.check_integrity()
    assert decode.num_available == decode.num_blocks and pair.prefill_blocks_held == 0
    assert not pair.consumer.arrived  # every intact transfer loaded
    pair.consumer.check_integrity()
    stats = pair.stats
    assert stats.transfers == len(PROMPTS)
    if fault is None:
        assert stats.rejected == 0
        prompt_kv = sum(len(p) for p in PROMPTS) * decode.pool.bytes_per_token
        assert stats.bytes_moved == prompt_kv  # exactly the prompts' KV, nothing more
        loaded = pair.consumer.stats  # through the consumer connector, one layer at a time
        assert loaded.requests == len(PROMPTS) and sum(loaded.layer_bytes) == prompt_kv
    else:
        assert stats.rejected == len(PROMPTS)  # every spoiled transfer recomputed


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
