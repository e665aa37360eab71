"""One regression test per class of defect that random mixes of features found (issue 36):
chunked prefill with its budget, n > 1 with sessions, tiers with chunked prefill, sessions
with recompute preemption; and one from issue 46: a refill decode that preempts a row of
its own step. Each failed on the engine before its fix.
`tests/test_engine_fuzz.py` draws these features together and hunts for the rest."""

from __future__ import annotations

import dataclasses

import kvlab
from kvlab.cache.prefix.hash import HashPrefixIndex
from kvlab.cache.tiers import TierConfig
from kvlab.config import SamplingParams
from kvlab.sequence import REQUEST_FIELDS, SAMPLE_FIELDS, Sequence

HOST = TierConfig(tiers=("host",), host_blocks=64)


def _engine(model, **config) -> kvlab.Engine:
    return kvlab.Engine(model, kvlab.EngineConfig(cache="paged", max_model_len=128, **config))


def _run(engine: kvlab.Engine, until=None, limit: int = 500) -> None:
    """Step (checking every invariant) until `until()` holds, or until nothing is left."""
    for _ in range(limit):
        if (until or (lambda: not engine.has_unfinished()))():
            return
        engine.step()
        engine.cache.check_integrity()
    raise AssertionError(f"not done after {limit} steps")


def _ids(n: int, start: int) -> list[int]:
    return list(range(start, start + n))


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


def _decoding(engine: kvlab.Engine) -> bool:
    return any(s.output_ids for s in engine.scheduler.running)


def session_residue(engine: kvlab.Engine, token_lists: list[list[int]], salt=None) -> dict:
    """Blocks holding a prefix of any of `token_lists` still kept anywhere: cached on the
    device, or in a tier (after end_session, all must be 0)."""
    cache = engine.cache
    keys = {k for t in token_lists for k in HashPrefixIndex(cache.block_size).keys(t, salt)}
    cached = {cache.index.block_of.get(k) for k in keys} & set(cache.allocator.cached)
    residue = {"device": len(cached)}
    for tier in cache.connector.stack.tiers if cache.connector else []:
        residue[tier.name] = sum(k in tier for k in keys)
    return residue


# 1. Chunked prefill, prefill-first: a chunk takes the whole budget, then preempts itself --
def test_decodes_run_when_the_prompt_chunk_that_crowded_them_out_is_preempted(tiny_model):
    engine = _engine(tiny_model, block_size=4, kv_budget_tokens=32, max_num_batched_tokens=8,
                     chunked_prefill=True, schedule_order="prefill-first")  # fmt: skip
    first = engine.add_request(_ids(13, 100), _greedy(12))
    _run(engine, until=lambda: _decoding(engine))
    engine.add_request(_ids(30, 200), SamplingParams(max_new_tokens=2, ignore_eos=True))
    _run(engine)  # its third chunk needs blocks the decode holds: it preempts itself
    [out] = [o for o in engine.finished if o.request_id == first]
    solo = _engine(tiny_model, block_size=4, kv_budget_tokens=128)
    assert out.token_ids == solo.generate([_ids(13, 100)], _greedy(12))[0].token_ids
    assert engine.scheduler.preemptions >= 1


# 2. n > 1 with sessions: every sample belongs to the request's session ---------------------
def test_a_fork_takes_every_field_of_its_request():
    fields = {f.name for f in dataclasses.fields(Sequence)}
    assert set(REQUEST_FIELDS) | set(SAMPLE_FIELDS) == fields
    assert not set(REQUEST_FIELDS) & set(SAMPLE_FIELDS)


def test_end_session_frees_every_sample_of_a_forked_request(tiny_model):
    engine = _engine(tiny_model, block_size=4, kv_budget_tokens=256, prefix_caching="hash",
                     tiers=HOST)  # fmt: skip
    params = SamplingParams(max_new_tokens=10, n=3, temperature=1.0, seed=1, ignore_eos=True)
    engine.add_request(_ids(9, 300), params, session="s")
    _run(engine)
    [out] = engine.finished
    tokens = [out.prompt_token_ids + s.token_ids for s in out.samples]
    assert len({tuple(t) for t in tokens}) == 3  # the samples differ: each left blocks
    engine.cache.connector.offload_cached()  # half of them down to the host tier
    engine.generate([_ids(40, 5000)], _greedy(1))  # the rest stays on the device
    engine.end_session("s")
    assert session_residue(engine, tokens) == {"device": 0, "host": 0}


def test_end_session_cancels_the_samples_still_running(model):
    """Sample 0 ends first (end of sequence after 3 tokens, seed 3); sample 1 still runs."""
    engine = kvlab.Engine(model, kvlab.EngineConfig(cache="paged", prefix_caching="hash",
                          max_model_len=256, kv_budget_tokens=2048))  # fmt: skip
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_new_tokens=16)
    request = engine.add_request("Answer with one word: is the sky blue?", params, session="s")
    [parent] = engine.scheduler.waiting
    _run(engine, until=lambda: parent.is_finished)
    [child] = [s for s in engine.scheduler.running if s.parent_id == request]
    ended = engine.end_session("s")
    assert ended.cancelled == 1 and child.finish_reason == "cancelled"
    assert not engine.has_unfinished()
    [out] = engine.finished
    assert [s.finish_reason for s in out.samples] == ["eos", "cancelled"]
    tokens = [out.prompt_token_ids + s.token_ids for s in out.samples]
    assert session_residue(engine, tokens) == {"device": 0}


# 3. Tiers and chunked prefill: admission counts the blocks a tier loads back -------------
def test_admission_counts_the_blocks_a_tier_loads_back(tiny_model):
    engine = _engine(tiny_model, block_size=4, kv_budget_tokens=64, prefix_caching="hash",
                     max_num_batched_tokens=8, chunked_prefill=True, tiers=HOST)  # fmt: skip
    document = _ids(33, 300)
    engine.generate([document], _greedy(2))
    assert engine.cache.connector.offload_cached() == 8  # its 8 full blocks to the host
    engine.add_request(_ids(29, 500), _greedy(3))  # holds half the pool while it decodes
    _run(engine, until=lambda: _decoding(engine))
    later = engine.add_request(document + [7, 8], _greedy(2))
    _run(engine)  # loading 8 blocks leaves no room for its first chunk: it waits
    [out] = [o for o in engine.finished if o.request_id == later]
    assert out.metrics.prefix_hit_tokens == 32
    solo = _engine(tiny_model, block_size=4, kv_budget_tokens=128)
    assert out.token_ids == solo.generate([document + [7, 8]], _greedy(2))[0].token_ids


# 4. Sessions and recompute preemption: what a preempted request published is freed -------
def test_end_session_frees_the_blocks_of_a_request_preempted_by_recompute(tiny_model):
    engine = _engine(tiny_model, block_size=4, kv_budget_tokens=64, prefix_caching="hash",
                     tiers=HOST)  # fmt: skip
    turn = engine.add_request(_ids(24, 700), _greedy(8), session="s")
    _run(engine, until=lambda: _decoding(engine))
    [seq] = engine.scheduler.running
    engine.scheduler.preempt(seq)  # recompute: num_computed 0, its blocks cached
    assert seq.num_computed == 0 and engine.cache.allocator.num_cached >= 6
    ended = engine.end_session("s")
    assert ended.cancelled == 1
    [out] = [o for o in engine.finished if o.request_id == turn]
    tokens = [out.prompt_token_ids + out.token_ids]
    assert session_residue(engine, tokens) == {"device": 0, "host": 0}
    assert engine.cache.allocator.num_cached == 0


# 5. Refill preempts a row of its own step (issue 46): the row leaves the step -------------
def test_a_refill_decode_that_preempts_a_scheduled_chunk_drops_it_from_the_step(tiny_model):
    """Step 12 schedules request 3's last chunk (9 tokens, into its second block) and
    admits request 4 (3 tokens) into the pool's last free block. The chunk preempts request
    4 for its block; the refill then decodes with the tokens request 4 gave back, and
    request 0's copy-on-write needs a block: the victim rule picks request 3, whose chunk
    is already in the step. It leaves the step and its 9 tokens go back to the budget (the
    engine once kept its row and published blocks it no longer held: KeyError in
    PagedCache.publish)."""
    engine = kvlab.Engine(tiny_model, kvlab.EngineConfig(
        cache="paged", block_size=32, kv_budget_tokens=256, max_model_len=64,
        prefix_caching="hash", admission="watermark", watermark=0.0, preemption="recompute",
        chunked_prefill=True, schedule_order="prefill-first", max_num_batched_tokens=12,
    ))  # fmt: skip
    lengths, priorities = (35, 34, 37, 35, 22), (2, 0, 0, 0, -1)
    prompts = [_ids(n, 1 + 100 * i) for i, n in enumerate(lengths)]
    news = (2, 2, 2, 1, 1)
    for i, (prompt, priority, new) in enumerate(zip(prompts, priorities, news)):
        params = SamplingParams(max_new_tokens=new, n=2 if i == 0 else 1, ignore_eos=True)
        engine.add_request(prompt, params, priority=priority)
    _run(engine)
    notes = {o.request_id: [n.text for n in o.notes if n.kind == "preemption"]
             for o in engine.finished}  # fmt: skip
    assert "request 3 needed 1 block(s) for its next 9 token(s)" in notes[4][0]
    assert "request 0 needed 1 block(s) for its next 1 token(s)" in notes[3][0]
    step = engine.stats().iloc[11]  # step 12: request 2 decodes on request 3's tokens
    assert (step["phase"], step["tokens"]) == ("decode", 4)
    solo = _engine(tiny_model, block_size=4, kv_budget_tokens=128)
    for out, prompt, new in zip(sorted(engine.finished, key=lambda o: o.request_id), prompts, news):
        expected = solo.generate([prompt], _greedy(new))[0].token_ids
        assert [s.token_ids for s in out.samples] == [expected] * len(out.samples)
