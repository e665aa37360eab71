"""Speculative decoding: proposers, verification, and rollback in every cache and codec."""

from __future__ import annotations

import pytest
import torch

import kvlab
from kvlab import EngineConfig, SamplingParams
from kvlab.build import check_config
from kvlab.cache.codecs import CODECS
from kvlab.config import SpeculativeConfig
from kvlab.speculative import PROPOSERS
from kvlab.speculative.ngram import lookup
from kvlab.speculative.verify import accept_greedy, accept_sampled
from kvlab.units import ceil_div

# Token loops (the random tiny model repeats itself) and quotes of the prompt: n-gram
# drafts get accepted; plain random tokens: they get rejected.
PROMPTS = [
    [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7],
    list(range(100, 140)) + list(range(100, 110)),
    [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4],
    [42] * 20,
    [11, 12, 13],
]


def run(model, prompts, params, step_check=None, **config) -> tuple[list, kvlab.Engine]:
    engine = kvlab.Engine(model, EngineConfig(max_model_len=256, **config))
    for prompt in prompts:
        engine.add_request(prompt, params)
    while engine.has_unfinished():
        engine.step()
        engine.cache.check_integrity()
        if step_check:
            step_check(engine)
    outs = sorted(engine.finished, key=lambda o: o.request_id)
    return [[s.token_ids for s in o.samples] for o in outs], engine


def tables_trimmed(engine) -> None:
    """After every step: no running sequence holds a block past its computed tokens + the
    pending one, and no drafts are left over."""
    for seq in engine.scheduler.running:
        assert not seq.draft_ids
        if engine.cache.name == "paged" and seq.output_ids:
            table = engine.cache.block_table(seq)
            assert len(table) <= ceil_div(seq.num_tokens, engine.cache.block_size)


# --- proposers -----------------------------------------------------------------------
def test_lookup_takes_the_earliest_match_of_the_longest_suffix():
    tokens = torch.tensor([1, 2, 3, 9, 2, 3, 8, 1, 2, 3])
    assert lookup(tokens, 1, 3, 2) == [9, 2]  # "1 2 3" first seen at 0, then 9, 2
    assert lookup(tokens, 1, 1, 3) == [9, 2, 3]  # "3" first seen at 2
    assert lookup(torch.tensor([1, 2, 3, 4]), 1, 3, 4) == []  # nothing repeats
    assert lookup(torch.tensor([7, 7]), 1, 4, 4) == [7]  # drafts stop at the end


def test_registered_proposers():
    assert set(PROPOSERS.names()) >= {"ngram", "layers"}


@pytest.mark.parametrize(
    "bad, field",
    [
        (dict(num_speculative_tokens=0), "num_speculative_tokens"),
        (dict(prompt_lookup_min=3, prompt_lookup_max=2), "prompt_lookup_min"),
        (dict(draft_layers=0), "draft_layers"),
    ],
)
def test_bad_speculative_configs_name_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig(**bad)
    with pytest.raises(ValueError, match=field):
        EngineConfig(speculative=bad)


def test_an_unknown_proposer_is_named_before_an_engine_is_built():
    config = EngineConfig(speculative={"method": "nope"})  # the registry is the engine's
    with pytest.raises(ValueError, match="speculative.method='nope' is unknown"):
        check_config(config)


def test_speculative_config_from_a_dict():
    config = EngineConfig(speculative={"method": "ngram", "num_speculative_tokens": 2})
    assert config.speculative == SpeculativeConfig("ngram", 2)
    with pytest.raises(ValueError, match="unknown field"):
        EngineConfig(speculative={"k": 2})


def test_a_draft_as_deep_as_the_model_is_refused(tiny_model):
    with pytest.raises(ValueError, match="draft_layers=2 must be below"):
        kvlab.Engine(tiny_model, EngineConfig(speculative={"method": "layers", "draft_layers": 2}))


# --- verification ----------------------------------------------------------------------
def test_greedy_acceptance_stops_at_the_first_disagreement():
    logits = torch.zeros(4, 10)
    for row, best in enumerate([3, 4, 7, 1]):
        logits[row, best] = 1.0
    assert accept_greedy(logits, [3, 4, 5]) == [3, 4, 7]
    assert accept_greedy(logits, [3, 4, 7]) == [3, 4, 7, 1]  # all accepted + one more
    assert accept_greedy(logits, [0, 4, 7]) == [3]


@pytest.mark.parametrize("draft", [0, 2, 5])
def test_rejection_sampling_preserves_the_distribution(draft):
    """The first emitted token follows p whatever the (deterministic) draft: drafts the
    model likes (0), dislikes (2) and forbids (5, filtered out by top_k)."""
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.5, 0.0, -9.0], [0.0] * 6])
    params = SamplingParams(temperature=1.0, top_k=5)
    p = torch.softmax(logits[0].masked_fill(torch.arange(6) == 5, -float("inf")), -1)
    generator = torch.Generator().manual_seed(draft)
    draws = 10_000
    counts = torch.zeros(6)
    for _ in range(draws):
        counts[accept_sampled(logits, [draft], params, generator)[0]] += 1
    total_variation = 0.5 * (counts / draws - p).abs().sum()
    assert total_variation < 0.025, (counts / draws, p)
    assert counts[5] == 0


# --- the engine: identical greedy outputs, rollback everywhere -----------------------------
SPECS = [
    {"method": "ngram", "num_speculative_tokens": 4},
    {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2},
    {"method": "layers", "num_speculative_tokens": 3, "draft_layers": 1},
]


@pytest.mark.parametrize("spec", SPECS, ids=["ngram-k4", "ngram-k2-min2", "layers-k3"])
@pytest.mark.parametrize(
    "config",
    [
        dict(cache="naive", kv_budget_tokens=1280),
        dict(cache="paged", block_size=1),
        dict(cache="paged", block_size=4, prefix_caching="hash"),
        dict(
            cache="paged",
            block_size=16,
            prefix_caching="radix",
            chunked_prefill=True,
            max_num_batched_tokens=16,
        ),
        dict(cache="paged", block_size=4, admission="watermark", kv_budget_tokens=96),
        dict(
            cache="paged",
            block_size=4,
            admission="watermark",
            kv_budget_tokens=96,
            preemption="swap",
        ),
    ],  # fmt: skip
    ids=["naive", "paged-b1", "hash-b4", "radix-chunked", "pressured", "pressured-swap"],
)
def test_greedy_outputs_equal_no_speculation(tiny_model, spec, config):
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    expected, _ = run(tiny_model, PROMPTS, params, **config)
    got, engine = run(tiny_model, PROMPTS, params, tables_trimmed, speculative=spec, **config)
    assert got == expected
    stats = engine.spec_stats()
    assert stats["drafted"] == stats["accepted"] + stats["rejected"] > 0
    assert stats["tokens_per_forward"] >= 1.0
    if "pressured" in str(config.get("kv_budget_tokens")):
        assert engine.scheduler.preemptions
    assert engine.cache.num_available == engine.cache.num_blocks  # nothing leaked


class Oracle(kvlab.speculative.Proposer):
    """Drafts the true greedy continuation (`truth`), or its tokens + 1 (`wrong`)."""

    truth: dict[tuple, list[int]] = {}
    wrong = False

    def propose(self, seqs, room):
        drafts = []
        for seq, k in zip(seqs, room):
            full = self.truth[tuple(seq.prompt_ids)]
            done = len(seq.output_ids)
            drafts.append([t + self.wrong for t in full[done : done + k]])
        return drafts


@pytest.mark.parametrize("wrong", [False, True])
def test_acceptance_follows_the_drafts(tiny_model, wrong):
    """Right drafts are all accepted (k + 1 tokens per forward), wrong ones all rejected
    (1 token per forward, every draft's slot rolled back); the outputs never change."""
    params = SamplingParams(max_new_tokens=25, ignore_eos=True)
    config = dict(cache="paged", block_size=2)
    expected, _ = run(tiny_model, PROMPTS, params, **config)
    Oracle.truth = {tuple(p): e[0] for p, e in zip(PROMPTS, expected)}
    Oracle.wrong = wrong
    PROPOSERS.register("oracle")(Oracle)
    try:
        spec = {"method": "oracle", "num_speculative_tokens": 3}
        got, engine = run(tiny_model, PROMPTS, params, tables_trimmed, speculative=spec, **config)
    finally:
        PROPOSERS.unregister("oracle")
    assert got == expected
    stats = engine.spec_stats()
    if wrong:
        assert stats["accepted"] == 0 and stats["tokens_per_forward"] == 1.0
        assert stats["rolled_back_blocks"] > 0
    else:
        assert stats["rejected"] == 0
        assert stats["tokens_per_forward"] == 4.0  # 24 decode tokens: 6 forwards of k + 1


@pytest.mark.parametrize("late", [False, True])
def test_rows_the_step_cuts_or_leaves_out_drop_their_drafts(tiny_model, late):
    """A budget of one token per decode cuts every row's drafts (the forward gives a row
    one logit only); a prefill-only step (no chunking, prefill first) leaves the decodes
    out. Right drafts must then neither be verified nor linger."""
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    config = dict(cache="paged", block_size=2, schedule_order="prefill-first")
    config |= (
        dict(chunked_prefill=False, max_num_batched_tokens=64)
        if late
        else dict(chunked_prefill=True, max_num_batched_tokens=len(PROMPTS))
    )
    expected, _ = run(tiny_model, PROMPTS, params, **config)
    Oracle.truth, Oracle.wrong = {tuple(p): e[0] for p, e in zip(PROMPTS, expected)}, False
    PROPOSERS.register("oracle")(Oracle)
    try:
        spec = {"method": "oracle", "num_speculative_tokens": 3}
        engine = kvlab.Engine(tiny_model, EngineConfig(max_model_len=256, speculative=spec,
                                                       **config))  # fmt: skip
        for prompt in PROMPTS:
            engine.add_request(prompt, params)
            for _ in range(3 if late else 0):  # the others decode, then a prompt arrives
                engine.step()
                tables_trimmed(engine)
        while engine.has_unfinished():
            engine.step()
            tables_trimmed(engine)
    finally:
        PROPOSERS.unregister("oracle")
    outs = sorted(engine.finished, key=lambda o: o.request_id)
    assert [[s.token_ids for s in o.samples] for o in outs] == expected
    assert engine.cache.num_available == engine.cache.num_blocks


def test_preemption_in_the_middle_of_speculation(tiny_model):
    """A pool so small that decodes preempt each other while carrying drafts."""
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    config = dict(cache="paged", block_size=2, admission="watermark", kv_budget_tokens=96)
    expected, _ = run(tiny_model, PROMPTS, params, **config)
    got, engine = run(tiny_model, PROMPTS, params, tables_trimmed, speculative=SPECS[0], **config)
    assert got == expected
    assert engine.scheduler.preemptions > 0 and engine.spec_stats()["rolled_back_blocks"] > 0


@pytest.mark.parametrize("kv_codec", [c for c in CODECS.names() if c != "kivi2"])
def test_every_codec_rolls_back(tiny_model, kv_codec):
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    config = dict(cache="paged", block_size=4, kv_codec=kv_codec)
    expected, _ = run(tiny_model, PROMPTS, params, **config)
    got, _ = run(tiny_model, PROMPTS, params, tables_trimmed, speculative=SPECS[0], **config)
    assert got == expected


def test_kivi2_drafts_never_complete_a_key_group(tiny_model):
    """kivi2 quantizes a 16-token key group when its last slot is written: drafts stop
    one short, so rejected drafts never reach a group's scales, and the outputs equal
    decoding without speculation (same groups, completed by the same writes)."""
    codec = CODECS["kivi2"]
    spec = kvlab.cache.KVSpec(1, 1, 4)
    kivi = codec(spec, 32, torch.float32, torch.device("cpu"))
    assert [kivi.draft_room(p) for p in (0, 13, 14, 15, 16)] == [14, 1, 0, 0, 14]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    config = dict(cache="paged", block_size=16, kv_codec="kivi2")
    expected, _ = run(tiny_model, PROMPTS, params, **config)
    got, engine = run(tiny_model, PROMPTS, params, tables_trimmed, speculative=SPECS[0], **config)
    assert got == expected
    assert engine.spec_stats()["rejected"] > 0


def test_forked_samples_roll_back_their_own_blocks(tiny_model):
    params = SamplingParams(max_new_tokens=20, n=3, temperature=0.0, ignore_eos=True)
    config = dict(cache="paged", block_size=4, prefix_caching="hash")
    expected, _ = run(tiny_model, PROMPTS[:3], params, **config)
    got, _ = run(tiny_model, PROMPTS[:3], params, tables_trimmed, speculative=SPECS[0], **config)
    assert got == expected


def test_drafts_never_reach_the_prefix_index(tiny_model):
    """Every block the index holds after the run is matched by some request's verified
    tokens: a block keyed by rejected drafts would match none."""
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    for index in ("hash", "radix"):
        config = dict(cache="paged", block_size=2, prefix_caching=index)
        _, engine = run(tiny_model, PROMPTS, params, speculative=SPECS[0], **config)
        cache, matched = engine.cache, set()
        for out in engine.finished:
            match = cache.index.match(out.prompt_token_ids + out.token_ids, None)
            matched.update(match.blocks)
            matched.add(match.partial_block)
        assert engine.spec_stats()["rejected"] > 0
        assert set(cache.allocator.cached) <= matched, index


def test_sampled_speculation_runs_clean(tiny_model):
    params = SamplingParams(max_new_tokens=24, temperature=0.8, seed=3, n=2, ignore_eos=True)
    got, engine = run(tiny_model, PROMPTS, params, tables_trimmed, cache="paged",
                      block_size=4, speculative=SPECS[0])  # fmt: skip
    assert all(len(s) == 24 for o in got for s in o)
    assert engine.spec_stats()["drafted"] > 0


def test_eos_inside_the_accepted_drafts_ends_the_request(tiny_model):
    """A request stops at its first EOS even when later drafts were accepted too."""
    params = SamplingParams(max_new_tokens=24)
    expected, _ = run(tiny_model, PROMPTS, params, cache="paged", block_size=4)
    got, _ = run(tiny_model, PROMPTS, params, cache="paged", block_size=4, speculative=SPECS[0])
    assert got == expected


def test_events_record_draft_verify_rollback(tiny_model):
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    _, engine = run(tiny_model, PROMPTS[:1], params, cache="paged", block_size=2,
                    record_block_map=True, speculative=SPECS[0])  # fmt: skip
    events = engine.speculator.events
    assert events and all(0 <= e.accepted <= len(e.drafts) for e in events)
    for e in events:
        assert len(e.kept) == ceil_div(e.position + 1 + e.accepted, 2)
        assert e.kept == e.table[: len(e.kept)]
