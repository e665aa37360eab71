"""The KV hierarchy in the engine, on the tiny model: identical greedy outputs, fewer
recomputed tokens, salts kept apart, damaged disk files recomputed, sessions freed."""

from __future__ import annotations

import pytest

import kvlab
from kvlab.cache.pool import KVPool
from kvlab.cache.tiers import TierConfig
from kvlab.config import SamplingParams
from kvlab.experiments import tiers as tier_exp
from kvlab.multiturn import chat_sessions, run_sessions
from kvlab.workloads import Request

ONE = SamplingParams(max_new_tokens=4)


def engine(model, tiers: TierConfig | None, pool_tokens: int = 256, **extra) -> kvlab.Engine:
    config = kvlab.EngineConfig(cache="paged", prefix_caching="hash", block_size=16,
                                kv_budget_tokens=pool_tokens, max_model_len=512, tiers=tiers,
                                **extra)  # fmt: skip
    return kvlab.Engine(model, config)


def prompt(seed: int, n: int = 100) -> list[int]:
    return [(seed * 7919 + 31 * i) % 40000 + 5 for i in range(n)]


def test_multi_turn_trace_three_times_the_pool(tiny_model):
    sessions = chat_sessions(n=6, turns=3, max_doc_chars=1200)
    result = tier_exp.compare_tiering(tiny_model, sessions, pool_tokens=384, max_new_tokens=6,
                                      max_model_len=1024)  # fmt: skip
    assert result["working_set_over_pool"] >= 3, result
    rows = result["configs"]
    assert all(row["identical_outputs"] for row in rows.values()), rows
    for name in ("host", "host+disk", "host+disk write-through", "host+disk prefetch"):
        assert rows[name]["recompute_reduction"] >= 0.5, (name, rows[name])
    disk = rows["host+disk"]["tiers"]["disk"]
    assert disk["loads"] > 0 and disk["corrupt"] == 0  # the small host tier spilled to disk
    # write-through copies a block down once, when its request releases it
    assert (
        rows["host+disk write-through"]["offloaded_blocks"] >= rows["host+disk"]["offloaded_blocks"]
    )
    assert rows["host+disk prefetch"]["prefetched_blocks"] > 0


def test_a_tier_hit_equals_recompute_and_never_crosses_salts(tiny_model):
    tiers = TierConfig(tiers=("host",), host_blocks=64)
    e, cold = engine(tiny_model, tiers), engine(tiny_model, None)
    ids = prompt(1)
    [expected] = cold.generate([ids], ONE)
    e.add_request(ids, ONE, salt="a")
    while e.has_unfinished():
        e.step()
    connector = e.cache.connector
    assert connector.offload_cached() == len(ids) // 16  # every full block of the prompt
    assert e.cache.allocator.num_cached == 0 and len(connector.stack.tier("host")) == 6
    seq = e.make_sequence(ids, ONE, salt="b")
    assert connector.get_num_new_matched_tokens(seq, 0) == (0, False)  # other salt: nothing
    [other] = e.run([Request(ids, 4, salt="b")])
    assert other.metrics.prefix_hit_tokens == 0
    assert connector.transfers.onloads == {}  # nothing was loaded for salt "b"
    seq = e.make_sequence(ids, ONE, salt="a")
    assert connector.get_num_new_matched_tokens(seq, 0) == (96, False)
    [same] = e.run([Request(ids, 4, salt="a")])
    assert same.metrics.prefix_hit_tokens == 96 and connector.transfers.onloads == {"host": 6}
    assert other.token_ids == same.token_ids == expected.token_ids
    assert any(n.kind == "tiers" for n in same.notes)
    e.cache.check_integrity()


@pytest.mark.parametrize("kv_codec", [None, "int8", "kivi2"])
def test_the_worker_side_moves_kv_layer_by_layer(tiny_model, kv_codec, monkeypatch):
    """Saves read, and loads write, one layer at a time in layer order (kivi2: whole)."""
    calls = []
    for name in ("read", "restore", "read_layer", "restore_layer"):
        method = getattr(KVPool, name)

        def spy(pool, *args, _name=name, _method=method):
            calls.append((_name, args[0] if _name.endswith("layer") else None))
            return _method(pool, *args)

        monkeypatch.setattr(KVPool, name, spy)
    e = engine(tiny_model, TierConfig(tiers=("host",), host_blocks=64), kv_codec=kv_codec)
    cold = engine(tiny_model, None, kv_codec=kv_codec)
    ids = prompt(2)
    [first] = e.generate([ids], ONE)
    calls.clear()
    blocks = e.cache.connector.offload_cached()
    assert blocks == len(ids) // 16
    layers = tiny_model.hf_model.config.num_hidden_layers
    layerwise = e.cache.pool.layerwise
    saves = [("read_layer", i) for i in range(layers)] if layerwise else [("read", None)]
    assert calls == saves * blocks
    calls.clear()
    [again] = e.generate([ids], ONE)
    loads = [("restore_layer", i) for i in range(layers) for _ in range(blocks)]
    assert calls[: len(loads) if layerwise else blocks] == (
        loads if layerwise else [("restore", None)] * blocks
    )
    assert e.cache.connector.transfers.onloads == {"host": blocks}
    assert first.token_ids == again.token_ids == cold.generate([ids], ONE)[0].token_ids
    e.cache.check_integrity()


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_disk_block_is_recomputed_not_served(tiny_model, tmp_path, damage):
    tiers = TierConfig(tiers=("host", "disk"), host_blocks=8, disk_blocks=8, disk_dir=str(tmp_path))
    e, cold = engine(tiny_model, tiers), engine(tiny_model, None)
    ids = prompt(2)
    [expected] = cold.generate([ids], ONE)
    e.generate([ids], ONE)
    connector = e.cache.connector
    connector.offload_cached()
    assert connector.stack.spill(0) == 6
    disk = connector.stack.tier("disk")
    victim = disk.path(e.cache.index.keys(ids, None)[2])  # the prompt's third block
    data = bytearray(victim.read_bytes())
    if damage == "truncate":
        victim.write_bytes(data[:-100])
    else:
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(data)
    [out] = e.generate([ids], ONE)
    assert disk.stats.corrupt == 1
    assert out.metrics.prefix_hit_tokens == 32  # blocks 0 and 1 from disk, the rest recomputed
    assert out.token_ids == expected.token_ids
    e.cache.check_integrity()
    e.cache.connector.stack.close()


def test_end_session_frees_its_blocks_on_every_tier(tiny_model, tmp_path):
    tiers = TierConfig(
        tiers=("host", "disk"), host_blocks=8, disk_blocks=64, disk_dir=str(tmp_path)
    )
    e = engine(tiny_model, tiers, pool_tokens=160)
    shared = prompt(3, 48)  # three blocks both sessions begin with
    for session, seed in (("alice", 4), ("bob", 5)):
        e.add_request(shared + prompt(seed, 80), ONE, session=session)
        while e.has_unfinished():
            e.step()
    stack = e.cache.connector.stack
    held = e.cache.allocator.num_cached + sum(stack.blocks().values())
    assert sum(stack.blocks().values()) > 0  # the small pool pushed blocks down
    ended = e.end_session("alice")
    assert ended.reason == "ended" and ended.cancelled == 0
    freed = sum(ended.freed.values())
    assert freed == 5  # alice's own 80 tokens: 5 blocks, wherever they were; shared stays
    assert e.cache.allocator.num_cached + sum(stack.blocks().values()) == held - freed
    [again] = e.generate([shared + prompt(5, 80)], ONE)  # bob's prefix still hits
    assert again.metrics.prefix_hit_tokens == 112  # all but the last block (its last token runs)
    e.end_session("bob")
    assert sum(stack.blocks().values()) == 0 and e.cache.allocator.num_cached <= 8
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="unknown"):
        e.end_session("alice")
    e.cache.check_integrity()


def test_session_ttl_frees_an_idle_session(tiny_model):
    e = engine(tiny_model, TierConfig(tiers=("host",), host_blocks=64), session_ttl_s=0.05)
    e.add_request(prompt(6), ONE, session="carol")
    while e.has_unfinished():
        e.step()
    assert e.cache.allocator.num_cached == 6
    import time

    time.sleep(0.1)
    e.step()  # nothing to run; the TTL check still happens
    assert [s.reason for s in e.sessions.ended] == ["ttl"]
    assert e.cache.allocator.num_cached == 0 and "carol" not in e.sessions.records


def test_end_session_cancels_its_running_turn(tiny_model):
    e = engine(tiny_model, None)
    rid = e.add_request(prompt(7), SamplingParams(max_new_tokens=8), session="dave")
    e.step()
    ended = e.end_session("dave")
    assert ended.cancelled == 1 and e.finished[-1].request_id == rid
    assert e.finished[-1].finish_reason == "cancelled" and e.cache.allocator.num_cached == 0
    with pytest.raises(ValueError, match="session=7 must be a string"):
        e.add_request(prompt(7), ONE, session=7)


def test_sessions_driver_feeds_answers_back(tiny_model):
    sessions = chat_sessions(n=2, turns=2, max_doc_chars=600)
    config = kvlab.EngineConfig(cache="paged", prefix_caching="hash", max_model_len=1024,
                                kv_budget_tokens=2048)  # fmt: skip
    e = kvlab.Engine(tiny_model, config)
    turns = run_sessions(e, sessions, max_new_tokens=4, end_after=True)
    by = {(t.session_id, t.turn): t for t in turns}
    first, second = by[("user-00", 0)], by[("user-00", 1)]
    # turn 2's prompt: turn 1's prompt, its answer (and an end marker), the new message
    assert second.prompt_ids[: first.prompt_tokens + 4] == first.prompt_ids + first.output_ids
    assert second.hit_tokens >= (first.prompt_tokens + 3) // 16 * 16
    assert [s.session_id for s in e.sessions.ended] == ["user-00", "user-01"]
    assert e.cache.allocator.num_cached == 0


def test_swap_preemption_goes_through_the_host_tier(tiny_model):
    tiers = TierConfig(tiers=("host", "disk"), host_blocks=8, disk_blocks=64)
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    prompts = [prompt(10 + i, 40) for i in range(4)]
    cold = engine(tiny_model, None, pool_tokens=1024)
    expected = [o.token_ids for o in cold.generate(prompts, params)]
    e = engine(tiny_model, tiers, pool_tokens=128, admission="watermark", preemption="swap")
    host = e.cache.connector.stack.tier("host")
    seen_holds = []
    for p in prompts:
        e.add_request(p, params)
    while e.has_unfinished():
        e.step()
        seen_holds.append(sum(host.held.values()))
        e.cache.check_integrity()
    assert e.scheduler.swapped_bytes > 0 and max(seen_holds) > 0
    assert not host.held
    assert [o.token_ids for o in sorted(e.finished, key=lambda o: o.request_id)] == expected
