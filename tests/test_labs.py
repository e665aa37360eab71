"""The classroom labs: every grader accepts kvlab's own part (its reference) and the lab
source's solution, rejects plausible wrong implementations naming the rule they break, and
the committed student notebooks are what generation makes of the sources."""

from __future__ import annotations

import contextlib
import functools
import io
import re

import nbformat
import pytest
import torch
from lab_mistakes import (
    LAB_NAMES,
    MISTAKES,
    EvictsMostRecentlyUsed,
    FreesOnFirstDecref,
    Mistake,
    answer,
    frees_shared_blocks,
    ignores_parent,
    ignores_salt,
    min_of_each_groups_hit,
    one_pass_over_the_windows,
    rounds_sinks_down,
    scans_windows_left_to_right,
)
from lab_mistakes import dequantize as right_dequantize
from lab_mistakes import truncates as truncating_quantize

from kvlab.cache import BlockAllocator, KVPool, KVSpec, PagedCache
from kvlab.cache.retention import DROPPED, RETENTION
from kvlab.config import SamplingParams
from kvlab.engine.scheduler import choose_victim
from kvlab.integrity import IntegrityError
from kvlab.labs import (
    KvlabHostTier,
    KvlabKVCache,
    KvlabScorer,
    LabFailure,
    capstone,
    check_block_allocator,
    check_block_hash,
    check_capstone,
    check_cross_group_hit,
    check_int8_codec,
    check_kv_cache,
    check_metrics_reading,
    check_precise_scorer,
    check_spec_rollback,
    check_tier_lru,
    check_victim_choice,
    check_window_release,
    hybrid_hit,
    kv_cache,
    kv_inputs,
    kvlab_block_keys,
    kvlab_cross_group_hit,
    kvlab_dequantize,
    kvlab_hit_rate,
    kvlab_parse,
    kvlab_preemptions,
    kvlab_quantize,
    kvlab_release,
    kvlab_rollback,
    student,
    victim,
)
from kvlab.sequence import Sequence

LABS = student.LABS
NAMES = list(LAB_NAMES)


@functools.cache
def tiny_model():
    """A 2-layer random Llama with the embedded tokenizer, built in memory (conftest's
    tiny_model, drawn the same way): the capstone grader's tests serve it, in seconds; the
    capstone's source notebook grades on SmolLM2-135M itself."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvlab.model.loading import LoadedModel

    tokenizer = capstone.capstone_model().tokenizer
    torch.manual_seed(2)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        vocab_size=tokenizer.vocab_size,
        tie_word_embeddings=True,
        initializer_range=0.3,
    )
    return LoadedModel(LlamaForCausalLM(config).eval(), tokenizer, "tiny-llama", 0.0)


def check_capstone_tiny(*parts, **kwargs):
    """The capstone's grader on the tiny model."""
    return check_capstone(*parts, model=tiny_model(), **kwargs)


GRADERS = {  # each lab's grader, called on a lab answer (a tuple of the names it defines)
    "00_kv_cache": check_kv_cache,
    "01_block_allocator": check_block_allocator,
    "02_block_hash": check_block_hash,
    "03_int8_codec": check_int8_codec,
    "04_preemption_victim": check_victim_choice,
    "05_spec_rollback": check_spec_rollback,
    "06_window_release": check_window_release,
    "07_tier_lru": check_tier_lru,
    "08_reading_metrics": check_metrics_reading,
    "09_precise_scorer": check_precise_scorer,
    "10_capstone": check_capstone_tiny,
    "11_hybrid_hit": check_cross_group_hit,
}
KVLAB_PARTS = {  # the library's own parts: the graders' references
    "00_kv_cache": (KvlabKVCache,),
    "01_block_allocator": (BlockAllocator,),
    "02_block_hash": (kvlab_block_keys,),
    "03_int8_codec": (kvlab_quantize, kvlab_dequantize),
    "04_preemption_victim": (choose_victim,),
    "05_spec_rollback": (kvlab_rollback,),
    "06_window_release": (kvlab_release,),
    "07_tier_lru": (KvlabHostTier,),
    "08_reading_metrics": (kvlab_parse, kvlab_hit_rate, kvlab_preemptions),
    "09_precise_scorer": (KvlabScorer,),
    "10_capstone": (BlockAllocator, kvlab_block_keys, choose_victim),
    "11_hybrid_hit": (kvlab_cross_group_hit,),
}


def grade(lab: str, *answer, verbose: bool = False):
    return GRADERS[lab](*answer, verbose=verbose)


def grade_mistake(mistake: Mistake):
    return grade(mistake.lab, *answer(mistake))


def assert_rejects(result, invariant: str, *phrases: str) -> None:
    """The grader failed, its first failure names `invariant`, and the report shows it."""
    assert not result.passed
    report = result.report()
    assert result.failures[0].invariant == invariant, report
    assert f"Broken invariant: {invariant}" in report
    for phrase in phrases:
        assert phrase in report, report


# --- the references and the known-wrong answers -------------------------------------------
@pytest.mark.parametrize("lab", NAMES)
def test_each_grader_accepts_kvlabs_own_part(lab, capsys):
    result = grade(lab, *KVLAB_PARTS[lab], verbose=True)
    assert result.passed and result.num_passed == len(result.checks) >= 5
    assert f"all {len(result.checks)} checks passed." in capsys.readouterr().out


@pytest.mark.parametrize("mistake", MISTAKES, ids=lambda m: f"{m.lab}-{m.name}")
def test_graders_reject_known_wrong_answers_naming_the_broken_invariant(mistake):
    result = grade_mistake(mistake)
    assert_rejects(result, mistake.invariant, *mistake.phrases)
    example = result.failures[0].example
    if mistake.lab == "00_kv_cache":  # runnable: the cache, its inputs, the calls
        assert example.startswith(f"cache = {mistake.name}(num_heads=")
        assert "kv_inputs(" in example and len(example.splitlines()) <= 14
    if mistake.lab == "01_block_allocator":
        assert f"a = {mistake.name}(" in example  # runnable, and short
        assert len(example.splitlines()) <= 8
    if mistake.lab == "08_reading_metrics":  # the call, after the lines it reads
        assert f"{mistake.name}(" in example and len(example.splitlines()) <= 24
    if mistake.lab == "04_preemption_victim":
        assert "running_seq(" in example
    if mistake.lab in ("05_spec_rollback", "06_window_release"):
        assert f"{mistake.name}([" in example  # the call itself, to paste and run
        assert len(example.splitlines()) <= 12
    if mistake.lab == "07_tier_lru":
        assert example.startswith(f"tier = {mistake.name}(")  # runnable, and short
        assert len(example.splitlines()) <= 8
    if mistake.lab == "11_hybrid_hit":  # the groups, what they hold, the call
        assert f"{mistake.name}(groups, lambda g, i: i in held[g], " in example
        assert example.startswith("groups = groups_of(") and len(example.splitlines()) == 3
    if mistake.lab == "10_capstone":  # the requests, then the call serving only those
        last = example.splitlines()[-1]
        assert last.startswith("check_capstone(make_allocator, block_keys, choose_victim, ")
        assert len(example.splitlines()) <= 8


def test_every_lab_has_known_wrong_answers():
    assert sorted({m.lab for m in MISTAKES}) == NAMES


def test_broken_allocators_also_break_the_real_paged_cache():
    result = check_block_allocator(FreesOnFirstDecref, verbose=False)
    failed = {f.check for f in result.failures}
    assert "inside PagedCache with hash prefix caching" in failed


def test_the_allocator_grader_lets_any_free_block_be_handed_out():
    class NewestFreeFirst(BlockAllocator):  # takes free blocks from the right: also correct
        def allocate(self):
            if self.free_blocks:
                block = self.free_blocks.pop()
                self.ref_counts[block] = 1
                return block
            return super().allocate()

    assert check_block_allocator(NewestFreeFirst, verbose=False).passed


def test_hash_grader_accepts_a_whole_prefix_hash():
    def whole_prefix(tokens, block_size, salt):  # a different, also correct design
        ends = range(block_size, len(tokens) + 1, block_size)
        return [hash((tuple(tokens[:end]), salt)) for end in ends]

    assert check_block_hash(whole_prefix, verbose=False).passed


@pytest.mark.parametrize("fn", [ignores_parent, ignores_salt])
def test_wrong_hashes_serve_wrong_kv_in_the_paged_cache(fn):
    result = check_block_hash(fn, verbose=False)
    paged = [f for f in result.failures if f.check.startswith("inside PagedCache")]
    assert paged and paged[0].invariant in (
        "a request reads back exactly the K/V written for its own prefix and tenant",
        "PagedCache.check_integrity() holds after every operation",
    )


@pytest.mark.parametrize(
    "heads, kv_heads, appends", [(2, 2, [3, 1, 2]), (9, 3, [4, 1]), (4, 1, [1, 1])]
)
def test_the_kv_cache_reference_is_pooled_attention_over_a_pool(heads, kv_heads, appends):
    # KvlabKVCache (kvlab's KVPool read by pooled_attention) equals attention written out
    q, k, v = kv_inputs(sum(appends), heads, kv_heads, 8, draw=5)
    ref, end = KvlabKVCache(heads, kv_heads, 8), 0
    for n in appends:
        ref.append(k[end : end + n], v[end : end + n])
        end += n
        assert torch.equal(ref.k, k[:end]) and torch.equal(ref.v, v[:end])
        plain = kv_cache._attention(q[end - n : end], k[:end], v[:end], 8**-0.5)
        torch.testing.assert_close(ref.attend(q[end - n : end]), plain.float())


def test_the_kv_cache_grader_compares_the_real_models_logits():
    # the model check runs: kvlab's runner through KvlabKVCache matches transformers without
    # a cache, and a cache that is right on the small checks' shapes only is caught there
    ids, want = kv_cache._no_cache_logits(kv_cache.MODEL_TEXTS[0])
    got = kv_cache.run_model_with_cache(KvlabKVCache, ids, [4] + [1] * (len(ids) - 4))
    assert got.shape == want.shape and float((got - want).abs().max()) <= kv_cache.MODEL_ATOL

    class OffAtTheModelsHeadDim(KvlabKVCache):  # right on the small checks' head sizes
        def attend(self, q):
            out = super().attend(q)
            return out * 0.999 if self.head_dim == 64 else out

    result = check_kv_cache(OffAtTheModelsHeadDim, verbose=False)
    assert [f.check for f in result.failures] == ["SmolLM2's logits through your cache"]
    assert "the next token would be" in result.failures[0].got


def test_int8_failures_are_cut_to_a_small_slice():
    failure = check_int8_codec(truncating_quantize, right_dequantize, verbose=False).failures[0]
    assert "# shape (1, 1, 1)" in failure.example or "# shape (1, 1, 2)" in failure.example


def test_the_victim_reference_is_the_real_scheduler():
    running = [
        victim.running_seq(i, priority=p, admit_order=a) for i, p, a in [(0, 0, 2), (1, 0, 5)]
    ]
    assert victim.kvlab_victim(running) is running[1] is choose_victim(running)
    assert [s.num_computed for s in running] == [32, 32]  # asking did not preempt anything


def _paged(block_size: int, num_blocks: int, retention=None) -> PagedCache:
    pool = KVPool(KVSpec(1, 1, 2), num_blocks * block_size, torch.float32, torch.device("cpu"))
    return PagedCache(pool, block_size, num_blocks * block_size, retention=retention)


def test_the_rollback_reference_is_kvlabs_rewind():
    # positions 0..8 in blocks [7, 3, 12]; 4 drafts (5..8), none accepted: block 12 goes
    assert kvlab_rollback([7, 3, 12], 4, 9, 4, 0) == (5, 2, [12])
    assert kvlab_rollback([7, 3, 12], 4, 9, 4, 0, {12: 2}) == (5, 2, [])  # a fork keeps it
    assert kvlab_rollback([7, 3, 12], 4, 9, 4, 3) == (8, 2, [12])  # ends at the boundary
    assert kvlab_rollback([7, 3, 12], 4, 9, 4, 4) == (9, 3, [])
    # the same as the real cache's rewind, which Speculator.rollback calls
    cache = _paged(4, 8)
    seq = Sequence(0, [1] * 13, SamplingParams(max_new_tokens=1))
    cache.allocate_slots(seq)
    seq.num_computed = 13
    table = list(cache.block_table(seq))
    assert cache.rewind(seq, 13 - (8 - 2)) == 2
    assert kvlab_rollback(table, 4, 13, 8, 2) == (7, 2, table[2:])
    assert (seq.num_computed, cache.block_table(seq)) == (7, table[:2])
    # kvlab itself refuses a shared block past the kept tokens: the lab handles it by decref
    child = Sequence(1, [1] * 7, SamplingParams(max_new_tokens=1))
    cache.ensure_capacity(seq, 9)
    seq.num_computed = 9
    cache.fork(seq, child)
    with pytest.raises(IntegrityError, match="shared or indexed"):
        cache.rewind(seq, 5)


@pytest.mark.parametrize("window, sinks", [(6, 0), (6, 2), (5, 8), (1, 0)])
def test_the_window_reference_is_what_the_paged_cache_drops(window, sinks):
    block_size = 4
    name = "sinks" if sinks else "window"
    args = (window, sinks) if sinks else (window,)
    cache = _paged(block_size, 32, RETENTION[name](block_size, 32, *args))
    seq = Sequence(0, [1] * 10, SamplingParams(max_new_tokens=40))
    cache.allocate_slots(seq, 0)
    mirror: list[int] = []  # the table as the lab's reference releases it
    for grow in [10, 1, 1, 3, 1, 1, 1, 4, 1, 1, 1, 1, 1, 8, 1, 1]:
        seq.num_computed += grow
        cache.ensure_capacity(seq, seq.num_computed)
        mirror += cache.block_table(seq)[len(mirror) :]
        released = kvlab_release(mirror, seq.num_computed, block_size, window, sinks)
        for i in released:
            mirror[i] = DROPPED
        cache.retain(seq)
        assert cache.block_table(seq) == mirror
        cache.check_integrity()
    assert DROPPED in mirror


def test_the_tier_reference_is_kvlabs_host_tier():
    ref = KvlabHostTier(2)
    assert ref.put("a", "tenant-a", "kv-a") == [] and ref.put("b", None, "kv-b") == []
    assert ref.get("a", "tenant-b") is None and ref.refused == 1 and ref.misses == 0
    assert ref.keys() == ["a", "b"]  # a refused lookup does not promote
    assert ref.get("a", "tenant-a") == "kv-a" and ref.keys() == ["b", "a"]
    assert ref.put("c", "tenant-a", "kv-c") == [("b", None, "kv-b")]  # goes one tier down
    assert ref.put("a", "tenant-a", "kv-a") == [] and ref.keys() == ["c", "a"]
    assert (ref.hits, ref.misses, ref.refused, ref.evictions) == (1, 0, 1, 1)
    # the same calls on HostTier itself: what the reference wraps
    assert ref.tier.keys() == ["c", "a"] and ref.tier.stats.evictions == 1
    ref.tier.check_integrity()


def test_the_metrics_reference_reads_the_saved_vllm_page_as_the_solution_does():
    from pathlib import Path

    from lab_mistakes import parse_metrics

    page = (Path(__file__).parent / "data" / "vllm_serve_metrics.txt").read_text()
    samples = kvlab_parse(page)
    assert parse_metrics(page) == samples
    assert ("vllm:prefix_cache_queries_total", 2816.0) in [(n, v) for n, _, v in samples]
    assert kvlab_hit_rate(page, page) == (None, "no queries")
    # its counters, as a later scrape: 512 more queries, 128 more hits, 2 preemptions
    later = page.replace("} 2816.0", "} 3328.0").replace("} 1536.0", "} 1664.0")
    name = "vllm:num_preemptions_total"
    later = re.sub(rf"^({name}{{.*}}) 0.0$", r"\1 2.0", later, flags=re.M)
    assert kvlab_hit_rate(page, later) == (0.25, "hits")
    assert kvlab_preemptions(page, later) == (2, 0.0)


def test_the_capstone_plugs_the_learners_parts_into_the_engine():
    from kvlab.build import Engine

    engine = Engine(tiny_model(), capstone.capstone_config())
    calls = []

    def recording_victim(running):  # the scheduler's seam: Scheduler.choose_victim
        calls.append([s.request_id for s in running])
        return choose_victim(running)

    capstone.plug_in(engine, EvictsMostRecentlyUsed, kvlab_block_keys, recording_victim)
    assert isinstance(engine.cache.allocator, EvictsMostRecentlyUsed)
    tokens = list(range(40))
    assert engine.cache.index.keys(tokens, "t") == kvlab_block_keys(tokens, 16, "t")
    ref = capstone.reference(tiny_model())
    requests = [r for r in ref.requests if r.wave == 0]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    for r in requests:
        engine.add_request(list(r.prompt_ids), params, salt=r.salt)
    while engine.has_unfinished():
        engine.step()
    assert calls and engine.scheduler.preemptions == len(calls)  # it chose every victim
    with pytest.raises(ValueError, match="has not served a request yet"):
        capstone.plug_in(engine, BlockAllocator, kvlab_block_keys, choose_victim)


def test_the_capstone_workload_shares_evicts_preempts_and_keeps_tenants_apart():
    for seed in (0, 2026):
        ref = capstone.reference(tiny_model(), seed)  # its tokens equal HF generate's
        served = ref.run.served
        assert served["b1"].hit_tokens >= 8 * capstone.BLOCK_SIZE  # the shared document
        assert served["a2"].hit_tokens >= served["b1"].hit_tokens  # its history, at least
        assert sum(s.preemptions for s in served.values()) >= 1
        assert served["y1"].hit_tokens < 2 * capstone.BLOCK_SIZE  # a1's blocks, moved: no hit
        assert ref.run.broke is None and ref.run.leaked is None
    # an allocator that evicts the most recently used block finds fewer of them cached
    result = check_capstone_tiny(EvictsMostRecentlyUsed, kvlab_block_keys, choose_victim)
    assert [f.check for f in result.failures] == ["prefix-cache hits per request equal kvlab's"]


def test_the_cross_group_hit_reference_is_the_longest_hit_every_group_serves():
    # kvlab's rule (full groups from the left, windows from the right, until none moves the
    # hit) equals trying every length, on the grader's random cases and its named ones
    cases = [hybrid_hit.random_case(c) for c in hybrid_hit._random_cases(300, 31)]
    cases += [c for named in hybrid_hit.NAMED.values() for c in named]
    assert all(hybrid_hit.kvlab_hit(c) == c.longest() for c in cases)
    assert {hybrid_hit.kvlab_hit(c) for c in cases} >= set(range(8))


def test_the_engine_serves_the_hit_kvlabs_rule_gives_and_the_checks_catch_wrong_rules():
    probes = hybrid_hit.engine_probes(0)  # SmolLM2 with cache="hybrid", 6 KV cache groups
    assert [p.case.windows for p in probes] == [(None, 32, 32, 32, 32, 32)] * len(probes)
    served = [p.hit_tokens for p in probes]
    assert served == [16 * hybrid_hit.kvlab_hit(p.case) for p in probes]
    assert served[:2] == [96, 80] and len(set(served)) >= 4  # evictions move the hit left
    engine = "the hit kvlab's engine serves"
    for wrong in (min_of_each_groups_hit, one_pass_over_the_windows, scans_windows_left_to_right):
        assert engine in {f.check for f in check_cross_group_hit(wrong, verbose=False).failures}


# --- grading behaviour ----------------------------------------------------------------------
def oldest_admitted(running):
    return max(running, key=lambda s: (-s.priority, -s.admit_order))


def test_raise_on_failure_and_crashes_point_at_the_learners_line():
    with pytest.raises(LabFailure, match="Broken invariant: among equal priorities"):
        check_victim_choice(oldest_admitted, verbose=False, raise_on_failure=True)

    def crashes(running):
        return running[0].no_such_field

    result = check_victim_choice(crashes, verbose=False)
    failure = result.failures[0]
    assert failure.invariant == "the code runs without crashing"
    assert "AttributeError" in failure.got and "running[0].no_such_field" in failure.got


def test_raise_for_check_raises_only_for_its_own_failed_check():
    result = check_victim_choice(oldest_admitted, verbose=False)
    failed = {f.check for f in result.failures}
    assert "most recently admitted first" in failed and "priorities" not in failed
    result.raise_for_check("priorities")  # passed: nothing raised
    with pytest.raises(LabFailure) as raised:
        result.raise_for_check("most recently admitted first")
    report = str(raised.value)
    assert report.startswith('Preemption victim: check "most recently admitted first" failed.')
    assert "Broken invariant: among equal priorities" in report and "Also failing" not in report
    with pytest.raises(ValueError, match="no check named 'newest'"):
        result.raise_for_check("newest")


def test_a_skeleton_is_reported_as_not_implemented(capsys):
    def choose(running):
        raise NotImplementedError

    result = check_victim_choice(choose)
    assert result.not_implemented and not result.passed
    assert "not implemented yet. choose() raised NotImplementedError" in capsys.readouterr().out
    with pytest.raises(LabFailure, match="not implemented yet"):
        result.raise_for_check("priorities")


# --- the sources and the generated student notebooks ----------------------------------------
def _source(name: str) -> nbformat.NotebookNode:
    return nbformat.read(LABS / "source" / name / f"{name}.ipynb", as_version=4)


def _run_cells(nb: nbformat.NotebookNode, name: str) -> tuple[dict, dict[str, BaseException]]:
    """Run a notebook's code cells in one namespace; {grade_id: what raised} for each cell."""
    namespace: dict = {"__name__": "__lab__"}
    raised: dict[str, BaseException] = {}
    with contextlib.redirect_stdout(io.StringIO()):
        for i, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
            try:
                exec(compile(cell.source, f"<{name} cell {i}>", "exec"), namespace)
            except Exception as error:
                raised[cell.metadata.get("nbgrader", {}).get("grade_id", f"cell {i}")] = error
    return namespace, raised


def test_there_are_twelve_labs_each_one_source_and_its_student_version():
    assert student.lab_names() == NAMES
    for name in NAMES:
        for suffix in (".ipynb", ".py"):
            assert (LABS / f"{name}{suffix}").exists()
            assert (LABS / "source" / name / f"{name}{suffix}").exists()
    assert not (LABS / "solutions").exists()


@pytest.mark.parametrize("name", NAMES)
def test_the_committed_student_notebooks_are_generated_from_the_sources(name):
    notebook, text = student.generate(name)
    hint = "edit the source, then run: python -m kvlab.labs.student"
    assert (LABS / f"{name}.ipynb").read_text() == notebook, hint
    assert (LABS / f"{name}.py").read_text() == text, hint


@pytest.mark.parametrize("name", NAMES)
def test_each_source_marks_its_solution_and_has_one_test_cell_per_check(name):
    nb = _source(name)
    meta = [c.metadata.get("nbgrader") for c in nb.cells]
    ids = [m["grade_id"] for m in meta if m]
    assert len(ids) == len(set(ids)), "grade_ids must be unique in a notebook"
    (exercise,) = [c for c, m in zip(nb.cells, meta) if m and m["solution"]]
    assert "### BEGIN SOLUTION" in exercise.source and "TODO" in exercise.source
    tests = [(c, m) for c, m in zip(nb.cells, meta) if m and m["grade"]]
    names = []
    for i, (cell, m) in enumerate(tests):  # the check's visible line, then its hidden twin
        visible = student.clear_hidden_tests(cell.source, True).split("\n")
        comment, _, call = visible
        check = re.fullmatch(r'result\.raise_for_check\((".*")\)', call).group(1)[1:-1]
        assert m["locked"] and m["points"] > 0
        assert f"{m['points']} point" in comment and f'"{check}"' in comment
        hidden = f'### BEGIN HIDDEN TESTS\nhidden.raise_for_check("{check}")\n### END HIDDEN TESTS'
        assert cell.source.endswith(f"{call}\n{hidden}")
        assert ("hidden = check_" in cell.source) == (i == 0)  # the first cell grades unseen cases
        names.append(check)
    assert names == grade(name, *KVLAB_PARTS[name]).checks  # every check, in the grader's order
    assert re.search(
        r"^hidden = check_\w+\(.*, verbose=False, seed=[1-9]\d*\)$", tests[0][0].source, re.M
    )
    code = [(c, m) for c, m in zip(nb.cells, meta) if c.cell_type == "code"]
    assert code[0][1]["grade_id"] == "setup" and code[0][1]["locked"]  # the imports
    (grader,) = [m for c, m in code if c.source.startswith("result = check_")]
    assert grader["locked"] and not grader["grade"]  # runs the grader once, prints its report
    # The cells that raise in the unsolved student version are tagged so that Run All (and
    # nbval) goes on past them: the "try it" cell and every check cell, nothing else.
    tagged = [m for c, m in code if "raises-exception" in c.metadata.get("tags", [])]
    assert tagged == [None] + [m for _, m in tests]


# The capstone's source serves SmolLM2-135M (30 s): nbval runs it in `make test`, and so does
# the nbgrader workflow's solved submission; its grader is tested here on the tiny model.
@pytest.mark.parametrize("name", [n for n in NAMES if n != "10_capstone"])
def test_each_source_runs_and_passes_every_check(name):
    namespace, raised = _run_cells(_source(name), name)
    assert not raised, raised
    assert namespace["result"].passed


@pytest.mark.parametrize("name", NAMES)
def test_student_notebooks_run_and_every_check_says_not_implemented(name):
    nb = nbformat.read(LABS / f"{name}.ipynb", as_version=4)
    text = nbformat.writes(nb)
    assert "BEGIN SOLUTION" not in text and "HIDDEN TESTS" not in text and "seed=" not in text
    assert not any(c.get("outputs") for c in nb.cells if c.cell_type == "code")
    namespace, raised = _run_cells(nb, name)
    assert namespace["result"].not_implemented
    tests = [c.metadata["nbgrader"]["grade_id"] for c in nb.cells if "nbgrader" in c.metadata]
    tests = [t for t in tests if t.startswith("check_")]
    assert tests and all(isinstance(raised[t], LabFailure) for t in tests)
    assert all("not implemented yet" in str(raised[t]) for t in tests)
    assert set(raised) <= {*tests, "cell 2"}  # and the "try it" cell, which calls the skeleton


@pytest.mark.parametrize("name", NAMES)
def test_sources_match_their_jupytext_pairs(name):
    jupytext = pytest.importorskip("jupytext")
    path = LABS / "source" / name / f"{name}.ipynb"
    paired = jupytext.read(path.with_suffix(".py"))
    code = [(c.source, c.metadata.get("nbgrader")) for c in paired.cells if c.cell_type == "code"]
    nb = _source(name)
    assert code == [
        (c.source, c.metadata.get("nbgrader")) for c in nb.cells if c.cell_type == "code"
    ]


def test_clear_hidden_tests_removes_each_region_in_grade_cells_only():
    source = "# 1 point\n### BEGIN HIDDEN TESTS\nh = 1\n### END HIDDEN TESTS\nassert x\n"
    twice = source + "### BEGIN HIDDEN TESTS\nassert h\n### END HIDDEN TESTS"
    assert student.clear_hidden_tests(twice, True) == "# 1 point\nassert x"
    assert student.clear_hidden_tests("assert x", False) == "assert x"
    with pytest.raises(ValueError, match="outside a grade cell"):
        student.clear_hidden_tests(source, False)
    with pytest.raises(ValueError, match="without"):
        student.clear_hidden_tests("### BEGIN HIDDEN TESTS\nx = 1", True)


def test_graders_with_an_unseen_seed_accept_kvlab_and_reject_every_known_mistake():
    seed = 2026  # the hidden tests' (a learner sees seed 0's cases)
    for lab in NAMES:
        assert GRADERS[lab](*KVLAB_PARTS[lab], verbose=False, seed=seed).passed, (lab, seed)
    for mistake in MISTAKES:
        result = GRADERS[mistake.lab](*answer(mistake), verbose=False, seed=seed)
        assert not result.passed, (mistake.name, seed)


def _memorizer(record: dict, right, wrong, key):
    """An answer that is right on the inputs in `record` (the cases a notebook shows), and
    `wrong` elsewhere: what hidden tests exist to catch."""

    def answer(*args):
        return right(*args) if key(*args) in record else wrong(*args)

    answer.__name__ = right.__name__
    return answer


def _recording(record: dict, fn, key):
    def answer(*args):
        record[key(*args)] = True
        return fn(*args)

    answer.__name__ = fn.__name__
    return answer


@pytest.mark.parametrize(
    "lab, right, wrong, key",
    [
        (
            "02_block_hash",
            kvlab_block_keys,
            lambda tokens, bs, salt: kvlab_block_keys(tokens, bs, None),  # ignores the salt
            lambda tokens, bs, salt: (tuple(tokens), bs, salt),
        ),
        (
            "04_preemption_victim",
            choose_victim,
            lambda running: min(running, key=lambda s: s.admit_order),  # the oldest
            lambda running: tuple((s.request_id, s.priority, s.admit_order) for s in running),
        ),
        (
            "05_spec_rollback",
            kvlab_rollback,
            frees_shared_blocks,
            lambda table, *rest: (tuple(table), *rest[:4], tuple(sorted(rest[4].items()))),
        ),
        (
            "06_window_release",
            kvlab_release,
            rounds_sinks_down,
            lambda table, *rest: (tuple(table), *rest),
        ),
        (
            "11_hybrid_hit",
            kvlab_cross_group_hit,
            min_of_each_groups_hit,
            lambda groups, cached, n, bs: (
                tuple(groups),
                n,
                bs,
                tuple(cached(g, i) for g in range(len(groups)) for i in range(n)),
            ),
        ),
    ],
)
def test_hidden_tests_catch_an_answer_that_is_right_only_on_the_cases_shown(lab, right, wrong, key):
    shown: dict = {}
    assert grade(lab, _recording(shown, right, key)).passed
    memorized = _memorizer(shown, right, wrong, key)
    assert grade(lab, memorized).passed  # the notebook's own checks cannot tell
    assert not GRADERS[lab](memorized, verbose=False, seed=2026).passed  # its hidden tests can


def test_metrics_hidden_tests_catch_a_hit_rate_right_only_on_the_pages_shown():
    from lab_mistakes import rate_from_totals

    shown: dict = {}
    key = lambda before, after: (before, after)  # noqa: E731
    parts = (kvlab_parse, _recording(shown, kvlab_hit_rate, key), kvlab_preemptions)
    assert check_metrics_reading(*parts, verbose=False).passed
    memorized = _memorizer(shown, kvlab_hit_rate, rate_from_totals, key)
    assert check_metrics_reading(kvlab_parse, memorized, kvlab_preemptions, verbose=False).passed
    hidden = check_metrics_reading(
        kvlab_parse, memorized, kvlab_preemptions, verbose=False, seed=2026
    )
    assert [f.check for f in hidden.failures] == ["the prefix-cache hit rate over an interval"]


def test_clear_solutions_keeps_the_todo_and_indents_the_stub():
    source = (
        "def f():\n    # TODO: add\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION\n"
    )
    assert student.clear_solutions(source, True) == (
        "def f():\n    # TODO: add\n    raise NotImplementedError\n"
    )
    assert student.clear_solutions("x = 1", True) == "raise NotImplementedError"
    assert student.clear_solutions("x = 1", False) == "x = 1"
    with pytest.raises(ValueError, match="outside a solution cell"):
        student.clear_solutions(source, False)
    with pytest.raises(ValueError, match="without"):
        student.clear_solutions("### BEGIN SOLUTION\nx = 1", True)
