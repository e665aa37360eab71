"""The decode pool's policy: least-loaded, on plain numbers and on live engines."""

from __future__ import annotations

import kvlab
from kvlab import EngineConfig, SamplingParams
from kvlab.disagg.routing import Load, least_loaded, load_of


def test_fewest_requests_then_most_free_blocks_then_first():
    assert least_loaded([Load(3, 90), Load(1, 10), Load(2, 50)]) == 1  # fewest requests
    assert least_loaded([Load(2, 10), Load(2, 40), Load(2, 40)]) == 1  # then most free
    assert least_loaded([Load(0, 8), Load(0, 8)]) == 0  # then the first
    assert least_loaded([Load(5, 0)]) == 0


def test_load_counts_every_unfinished_request(tiny_model):
    engine = kvlab.Engine(tiny_model, EngineConfig(cache="paged", block_size=4, max_model_len=64))
    idle = load_of(engine)
    assert idle == Load(0, engine.cache.num_blocks)
    engine.add_request(list(range(10, 19)), SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert load_of(engine).requests == 1  # waiting counts
    engine.step()  # prefilled: 9 prompt tokens and the first token in 3 blocks of 4
    assert load_of(engine) == Load(1, engine.cache.num_blocks - 3)
    while engine.has_unfinished():
        engine.step()
    assert load_of(engine) == idle
