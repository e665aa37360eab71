"""Fragmentation (notebook 02): reservation, internal and external, on hand-built cases."""

from __future__ import annotations

import pytest
import torch

import kvlab
from kvlab.cache import KVPool, KVSpec, OutOfBlocks, PagedCache
from kvlab.cache.naive import NaiveCache
from kvlab.config import SamplingParams
from kvlab.experiments.fragmentation import (
    INTERNAL,
    RESERVATION,
    ContiguousAllocator,
    StreamRequest,
    paged_admit,
    replay_stream,
    sequence_waste,
    trace_waste,
    waste_by_request,
)
from kvlab.sequence import Sequence
from kvlab.viz.fragmentation import refusal_strip
from kvlab.workloads import Request

WRITTEN = [5, 16, 17]  # tokens each of three sequences has written


def _pool(slots: int) -> KVPool:
    return KVPool(KVSpec(1, 1, 2), slots, torch.float32, torch.device("cpu"))


def _fill(cache) -> None:
    """Admit three sequences and mark WRITTEN tokens of each as stored."""
    for i, n in enumerate(WRITTEN):
        seq = Sequence(i, [1] * n, SamplingParams(max_new_tokens=4))
        cache.allocate_slots(seq)
        seq.num_computed = n


def test_internal_fragmentation_is_the_tail_of_the_last_block():
    cache = PagedCache(_pool(16 * 8), block_size=16, max_model_len=64)
    _fill(cache)
    rows = sequence_waste(cache)
    assert [r["held"] for r in rows] == [16, 16, 32]
    assert [r["unwritten"] for r in rows] == [11, 0, 15]  # at most block_size - 1 each
    assert {r["kind"] for r in rows} == {INTERNAL}
    waste = cache.memory().waste_bytes // cache.pool.bytes_per_token
    assert sum(r["unwritten"] for r in rows) == waste == 26


def test_reservation_is_max_model_len_beyond_what_is_written():
    cache = NaiveCache(_pool(64 * 3), max_model_len=64)
    _fill(cache)
    rows = sequence_waste(cache)
    assert [r["held"] for r in rows] == [64, 64, 64]
    assert [r["unwritten"] for r in rows] == [59, 48, 47]
    assert {r["kind"] for r in rows} == {RESERVATION}
    waste = cache.memory().waste_bytes // cache.pool.bytes_per_token
    assert sum(r["unwritten"] for r in rows) == waste == 154


def _fragmented() -> ContiguousAllocator:
    """10 units: A [0, 3), B [3, 5), C [5, 8), D [8, 10); B and D finish: holes of 2 and 2."""
    layout = ContiguousAllocator(10)
    assert [layout.allocate(owner, size) for owner, size in enumerate((3, 2, 3, 2))] == [0, 3, 5, 8]
    layout.free(1)
    layout.free(3)
    layout.check_integrity()
    return layout


def test_contiguous_refuses_while_the_free_total_suffices():
    layout = _fragmented()
    assert layout.holes() == [(3, 2), (8, 2)]
    assert layout.free_total == 4 and layout.largest_hole == 2
    assert layout.allocate(4, 3) is None  # 4 free >= 3 needed, but no hole of 3
    assert layout.allocate(5, 2) == 3  # first fit: the lowest hole large enough
    layout.check_integrity()


def test_first_fit_takes_the_lowest_hole_not_the_snuggest():
    layout = ContiguousAllocator(32)  # notebook 02's exercise "02.first-fit"
    layout.regions = dict(enumerate([(0, 6), (10, 8), (20, 9)]))
    assert layout.holes() == [(6, 4), (18, 2), (29, 3)]
    assert layout.allocate(3, 3) == 6  # best fit would take the hole at 29
    assert layout.allocate(4, 4) is None and layout.free_total == 6  # holes 1, 2, 3
    assert layout.allocate(5, 2) == 18
    layout.check_integrity()


def test_paged_admits_the_same_request_from_the_same_free_blocks():
    blocks, owners = paged_admit(_fragmented(), owner=4, need=3)
    assert blocks == [3, 4, 8]  # both holes, in address order
    assert owners == [0, 0, 0, 4, 4, 2, 2, 2, 4, -1]
    with pytest.raises(OutOfBlocks):
        paged_admit(_fragmented(), owner=4, need=5)  # more than is free in total


def test_contiguous_allocator_errors_name_the_owner():
    layout = _fragmented()
    with pytest.raises(ValueError, match="owner 0 holds a region"):
        layout.allocate(0, 1)
    with pytest.raises(ValueError, match="double free"):
        layout.free(1)
    with pytest.raises(ValueError, match="size=0"):
        layout.allocate(7, 0)


def test_a_stream_meets_external_fragmentation_and_paged_does_not():
    # 10 blocks, all taken at step 0: A [0, 3), B [3, 6), C [6, 8), D [8, 10). B finishes
    # at step 2, D at step 4: holes of 3 and 2. E (4 blocks) arrives at step 4: 5 are free.
    stream = [
        StreamRequest(0, arrival=0, need=3, lifetime=6),
        StreamRequest(1, arrival=0, need=3, lifetime=2),
        StreamRequest(2, arrival=0, need=2, lifetime=6),
        StreamRequest(3, arrival=0, need=2, lifetime=4),
        StreamRequest(4, arrival=4, need=4, lifetime=1),
    ]
    replay = replay_stream(stream, num_blocks=10)
    first = replay.first
    assert (first.step, first.request, first.need) == (4, 4, 4)
    assert (first.free_total, first.largest_hole) == (5, 3)
    assert first.holes == [(3, 3), (8, 2)]
    assert first.regions == {0: (0, 3), 2: (6, 2)}
    assert first.paged_blocks == [3, 4, 5, 8]  # the same free blocks, from both holes
    assert first.paged_runs() == [(3, 5), (8, 8)]
    summary = replay.summary()
    assert summary.loc["contiguous", "steps refused with enough free"] == 2  # steps 4, 5
    assert summary.loc["paged", "steps refused with enough free"] == 0
    assert summary.loc["contiguous", "steps"] == 7 and summary.loc["paged", "steps"] == 6
    figure = refusal_strip(first, block_size=16)
    names = {trace.name for trace in figure.data}
    assert {"free", "request 0", "request 2", "request 4 (needs 4)"} == names
    assert "largest hole has 3" in figure.layout.title.text
    need_bar = figure.data[0]
    assert (need_bar.base[0], need_bar.x[0]) == (3, 4)  # over the hole [3, 6), past its end


def test_a_stream_that_never_fragments_has_no_refusal():
    stream = [StreamRequest(i, arrival=0, need=2, lifetime=1 + i) for i in range(3)]
    replay = replay_stream(stream, num_blocks=6)
    assert replay.first is None and replay.refusals.empty
    with pytest.raises(ValueError, match="needs 7 blocks > num_blocks=6"):
        replay_stream([StreamRequest(0, 0, need=7, lifetime=1)], num_blocks=6)


@pytest.mark.parametrize("cache", ["naive", "paged"])
def test_trace_waste_serves_as_run_does_and_adds_up_to_the_cache_s_waste(tiny_model, cache):
    ids = tiny_model.tokenizer.encode("one two three four five six seven eight nine ten")
    requests = [Request(ids[:n], max_new_tokens=3) for n in (5, 9)]

    def engine() -> kvlab.Engine:
        config = kvlab.EngineConfig(
            cache=cache, block_size=4, max_model_len=32, kv_budget_tokens=64
        )
        return kvlab.Engine(tiny_model, config)

    traced = engine()
    outputs, trace = trace_waste(traced, requests, ignore_eos=True)
    reference = engine().run(requests, ignore_eos=True)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in reference]
    stats = traced.stats().set_index("step")
    per_step = trace.groupby("step")["unwritten"].sum() * traced.cache.pool.bytes_per_token
    assert per_step.to_dict() == stats.loc[per_step.index, "waste_bytes"].to_dict()
    table = waste_by_request(trace)
    assert table["written first"].tolist() == [5, 9]  # the prompts, after prefill
    # + 1 after the step before the last: the last step writes one more and finishes it
    assert table["written last"].tolist() == [6, 10]
    if cache == "paged":
        assert table["unwritten first"].tolist() == [3, 3] and table["unwritten max"].max() <= 3
    else:
        assert table["unwritten first"].tolist() == table["unwritten max"].tolist() == [27, 23]
