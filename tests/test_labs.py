"""The classroom labs: every grader accepts the reference solution, rejects plausible wrong
implementations naming the rule they break, and the exercise notebooks match the solved ones."""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import io
from pathlib import Path

import nbformat
import pytest
import torch

from kvlab.cache import OutOfBlocks
from kvlab.labs import (
    LabFailure,
    allocator,
    check_block_allocator,
    check_block_hash,
    check_int8_codec,
    check_victim_choice,
    hashing,
    int8,
    solutions,
    victim,
)
from kvlab.labs.solutions import LabBlockAllocator

LABS = Path(__file__).resolve().parent.parent / "notebooks" / "labs"
EXERCISE_MARK = "# EXERCISE:"
SOLUTION_MARK = "# SOLUTION"


def assert_rejects(result, invariant: str, *phrases: str) -> None:
    """The grader failed, its first failure names `invariant`, and the report shows it."""
    assert not result.passed
    report = result.report()
    assert result.failures[0].invariant == invariant, report
    assert f"Broken invariant: {invariant}" in report
    for phrase in phrases:
        assert phrase in report, report


# --- lab 1: block allocator -----------------------------------------------------------------
class FreesOnFirstDecref(LabBlockAllocator):
    """Forgets the reference count: the first decref frees a shared block."""

    def decref(self, block, keep_cached=False):
        if self.ref_counts[block] <= 0:
            raise ValueError("double free")
        self.ref_counts[block] = 0
        if keep_cached:
            self.cached[block] = None
            return False
        self.free_blocks.append(block)
        return True


class AllowsDoubleFree(LabBlockAllocator):
    """Clamps the count at zero instead of raising: a double free goes unnoticed."""

    def decref(self, block, keep_cached=False):
        self.ref_counts[block] = max(0, self.ref_counts[block] - 1)
        if self.ref_counts[block]:
            return False
        if keep_cached:
            self.cached[block] = None
            return False
        self.free_blocks.append(block)
        return True


class LosesUncachedBlocks(LabBlockAllocator):
    """uncache() drops the block without putting it on the free list: it is lost."""

    def uncache(self, block):
        del self.cached[block]


class EvictsMostRecentlyUsed(LabBlockAllocator):
    """popitem() takes the most recently used cached block."""

    def allocate(self):
        if self.free_blocks:
            block = self.free_blocks.popleft()
        elif self.cached:
            block, _ = self.cached.popitem()
            if self.on_evict:
                self.on_evict(block)
        else:
            raise OutOfBlocks("no block")
        self.ref_counts[block] = 1
        return block


class RevivedBlockStaysCached(LabBlockAllocator):
    """incref() of a cached block forgets to take it out of the cache."""

    def incref(self, block):
        if block not in self.cached and self.ref_counts[block] <= 0:
            raise ValueError("free block")
        self.ref_counts[block] += 1


class EvictsBeforeUsingFreeBlocks(LabBlockAllocator):
    """Takes a cached block even though free ones are left (loses cache hits)."""

    def allocate(self):
        if self.cached:
            block, _ = self.cached.popitem(last=False)
            if self.on_evict:
                self.on_evict(block)
        elif self.free_blocks:
            block = self.free_blocks.popleft()
        else:
            raise OutOfBlocks("no block")
        self.ref_counts[block] = 1
        return block


def test_allocator_grader_accepts_the_solution_and_the_library(capsys):
    from kvlab.cache import BlockAllocator

    for cls in (LabBlockAllocator, BlockAllocator):
        result = check_block_allocator(cls)
        assert result.passed and result.num_passed == len(result.checks) == 5
    assert "Block allocator: all 5 checks passed." in capsys.readouterr().out


@pytest.mark.parametrize(
    "cls, invariant, phrases",
    [
        (FreesOnFirstDecref, allocator.LAST_REF, ["a.incref(0)", "still has 1 reference"]),
        (AllowsDoubleFree, allocator.DOUBLE_FREE, ["a.decref(0)", "ValueError"]),
        (LosesUncachedBlocks, allocator.CONSERVED, ["a.uncache(0)", "num_free=1"]),
        (EvictsMostRecentlyUsed, allocator.LRU, ["least recently used first, are [1, 0]"]),
        (RevivedBlockStaysCached, allocator.ONE_STATE, ["take it out of `cached`"]),
        (EvictsBeforeUsingFreeBlocks, allocator.FREE_FIRST, ["while blocks [1] were free"]),
    ],
)
def test_allocator_grader_rejects_wrong_allocators(cls, invariant, phrases):
    result = check_block_allocator(cls, verbose=False)
    assert_rejects(result, invariant, *phrases)
    assert f"a = {cls.__name__}(" in result.failures[0].example  # runnable, and short
    assert len(result.failures[0].example.splitlines()) <= 8


def test_broken_allocators_also_break_the_real_paged_cache():
    result = check_block_allocator(FreesOnFirstDecref, verbose=False)
    failed = {f.check for f in result.failures}
    assert "inside PagedCache with hash prefix caching" in failed


# --- lab 2: chained block hash --------------------------------------------------------------
def ignores_parent(tokens, block_size, salt):
    starts = range(0, len(tokens) - block_size + 1, block_size)
    return [hash((tuple(tokens[s : s + block_size]), salt)) for s in starts]


def ignores_salt(tokens, block_size, salt):
    keys, parent = [], None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, tuple(tokens[start : start + block_size])))
        keys.append(parent)
    return keys


def joins_digits(tokens, block_size, salt):
    keys, parent = [], ""
    for start in range(0, len(tokens) - block_size + 1, block_size):
        text = parent + (salt or "") + "".join(str(t) for t in tokens[start : start + block_size])
        parent = hashlib.sha256(text.encode()).hexdigest()
        keys.append(parent)
    return keys


def keys_the_partial_block(tokens, block_size, salt):
    keys, parent = [], None
    for start in range(0, len(tokens), block_size):
        parent = hash((parent, tuple(tokens[start : start + block_size]), salt))
        keys.append(parent)
    return keys


def hashes_the_sum(tokens, block_size, salt):
    keys, parent = [], 0
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, sum(tokens[start : start + block_size]), salt))
        keys.append(parent)
    return keys


def test_hash_grader_accepts_the_solution_and_a_whole_prefix_hash(capsys):
    def whole_prefix(tokens, block_size, salt):  # a different, also correct design
        ends = range(block_size, len(tokens) + 1, block_size)
        return [hash((tuple(tokens[:end]), salt)) for end in ends]

    for fn in (solutions.block_keys, whole_prefix):
        assert check_block_hash(fn).passed
    assert "Chained block hash: all 7 checks passed." in capsys.readouterr().out


@pytest.mark.parametrize(
    "fn, invariant, phrases",
    [
        (ignores_parent, hashing.CHAINED, ["block_keys([1, 2, 5, 6], 2, None)[1] =="]),
        (ignores_salt, hashing.SALTED, ["'tenant-a'"]),
        (joins_digits, hashing.DISTINCT, ['"1"+"23" == "12"+"3"']),
        (keys_the_partial_block, hashing.FULL_BLOCKS, ["len(block_keys([1], 2, None)) == 1"]),
        (hashes_the_sum, hashing.DISTINCT, ["block_keys([1, 2], 2, None)[0] == block_keys([2, 1]"]),
    ],
)
def test_hash_grader_rejects_wrong_hashes(fn, invariant, phrases):
    assert_rejects(check_block_hash(fn, verbose=False), invariant, *phrases)


@pytest.mark.parametrize("fn", [ignores_parent, ignores_salt])
def test_wrong_hashes_serve_wrong_kv_in_the_paged_cache(fn):
    result = check_block_hash(fn, verbose=False)
    paged = [f for f in result.failures if f.check.startswith("inside PagedCache")]
    assert paged and paged[0].invariant in (
        "a request reads back exactly the K/V written for its own prefix and tenant",
        "PagedCache.check_integrity() holds after every operation",
    )


# --- lab 3: int8 codec ----------------------------------------------------------------------
def dequantize(q, scale):
    return q.float() * scale.float()[..., None]


def per_tensor_scale(x):
    s = x.abs().max() / 127
    return (x / s).round().clamp(-127, 127).to(torch.int8), s.expand(x.shape[:2])


def per_tensor_scalar(x):
    s = x.abs().max() / 127
    return (x / s).round().clamp(-127, 127).to(torch.int8), s


def truncates(x):
    s = x.abs().amax(-1) / 127
    safe = torch.where(s > 0, s, 1.0)[..., None]
    return (x / safe).clamp(-127, 127).to(torch.int8), s


def overflows(x):  # amax / 128 and no clamp: the largest value wraps around
    s = x.abs().amax(-1) / 128
    safe = torch.where(s > 0, s, 1.0)[..., None]
    return (x / safe).round().to(torch.int8), s


def float16_scale(x):
    s = (x.abs().amax(-1) / 127).half()
    safe = torch.where(s > 0, s, 1.0)[..., None].float()
    return (x / safe).round().clamp(-127, 127).to(torch.int8), s


def test_int8_grader_accepts_the_solution(capsys):
    result = check_int8_codec(solutions.quantize_int8, solutions.dequantize_int8)
    assert result.passed and len(result.checks) == 6
    assert "Int8 KV codec: all 6 checks passed." in capsys.readouterr().out


@pytest.mark.parametrize(
    "quantize, invariant, phrases",
    [
        (per_tensor_scale, int8.BOUND, ["every token and head got the same scale"]),
        (per_tensor_scalar, int8.SHAPES, ["scale.shape == ()", "one scale per token per KV"]),
        (truncates, int8.BOUND, ["round to nearest", "x = torch.tensor([[["]),
        (overflows, int8.BOUND, ["overflows int8"]),
        (float16_scale, int8.BOUND, ["underflowed to 0"]),
    ],
)
def test_int8_grader_rejects_wrong_codecs(quantize, invariant, phrases):
    assert_rejects(check_int8_codec(quantize, dequantize, verbose=False), invariant, *phrases)


def test_int8_failures_are_cut_to_a_small_slice():
    failure = check_int8_codec(truncates, dequantize, verbose=False).failures[0]
    assert "# shape (1, 1, 1)" in failure.example or "# shape (1, 1, 2)" in failure.example


# --- lab 4: preemption victim ---------------------------------------------------------------
def oldest_admitted(running):
    return max(running, key=lambda s: (-s.priority, -s.admit_order))


def ignores_priority(running):
    return max(running, key=lambda s: s.admit_order)


def latest_arrival(running):
    return max(running, key=lambda s: (-s.priority, s.arrival_s))


def highest_priority(running):
    return max(running, key=lambda s: (s.priority, s.admit_order))


def sorts_in_place(running):
    running.sort(key=lambda s: (-s.priority, s.admit_order))
    return running[-1]


def returns_request_id(running):
    return solutions.choose_victim(running).request_id


def test_victim_grader_accepts_the_solution(capsys):
    assert check_victim_choice(solutions.choose_victim).passed
    assert "Preemption victim: all 5 checks passed." in capsys.readouterr().out


@pytest.mark.parametrize(
    "fn, invariant, phrases",
    [
        (oldest_admitted, victim.NEWEST, ["chose request 0", "Expected: request 1"]),
        (ignores_priority, victim.PRIORITY, ["chose request 1 (priority 1"]),
        (latest_arrival, victim.NEWEST, ["arrival_s never changes"]),
        (highest_priority, victim.PRIORITY, ["larger `priority` is more important"]),
        (sorts_in_place, victim.UNCHANGED, ["don't pop or remove it"]),
        (returns_request_id, victim.RETURNS_ONE, ["not its index or request_id"]),
    ],
)
def test_victim_grader_rejects_wrong_choices(fn, invariant, phrases):
    result = check_victim_choice(fn, verbose=False)
    assert_rejects(result, invariant, *phrases)
    assert "running_seq(" in result.failures[0].example


def test_the_reference_is_the_real_scheduler():
    running = [
        victim.running_seq(i, priority=p, admit_order=a) for i, p, a in [(0, 0, 2), (1, 0, 5)]
    ]
    assert victim.kvlab_victim(running) is running[1]
    assert [s.num_computed for s in running] == [32, 32]  # asking did not preempt anything


# --- grading behaviour ----------------------------------------------------------------------
def test_raise_on_failure_and_crashes_point_at_the_learners_line():
    with pytest.raises(LabFailure, match="Broken invariant: among equal priorities"):
        check_victim_choice(oldest_admitted, verbose=False, raise_on_failure=True)

    def crashes(running):
        return running[0].no_such_field

    result = check_victim_choice(crashes, verbose=False)
    failure = result.failures[0]
    assert failure.invariant == "the code runs without crashing"
    assert "AttributeError" in failure.got and "running[0].no_such_field" in failure.got


def test_a_skeleton_is_reported_as_not_implemented(capsys):
    def choose(running):
        raise NotImplementedError

    result = check_victim_choice(choose)
    assert result.not_implemented and not result.passed
    assert "not implemented yet. choose() raised NotImplementedError" in capsys.readouterr().out


# --- the notebooks --------------------------------------------------------------------------
NAMES = sorted(p.stem for p in LABS.glob("*.ipynb"))
SOLVED = {
    "01_block_allocator": [solutions.LabBlockAllocator],
    "02_block_hash": [solutions.block_keys],
    "03_int8_codec": [solutions.quantize_int8, solutions.dequantize_int8],
    "04_preemption_victim": [solutions.choose_victim],
}


def test_there_are_four_labs_each_with_a_solved_copy():
    assert NAMES == sorted(SOLVED)
    assert sorted(p.stem for p in (LABS / "solutions").glob("*.ipynb")) == NAMES


def _code_cells(path: Path) -> list[str]:
    nb = nbformat.read(path, as_version=4)
    return [c.source for c in nb.cells if c.cell_type == "code"]


@pytest.mark.parametrize("name", NAMES)
def test_exercise_and_solution_differ_only_in_the_exercise_cell(name):
    exercise = nbformat.read(LABS / f"{name}.ipynb", as_version=4).cells
    solved = nbformat.read(LABS / "solutions" / f"{name}.ipynb", as_version=4).cells
    assert len(exercise) == len(solved)
    marked = [i for i, c in enumerate(exercise) if c.source.startswith(EXERCISE_MARK)]
    assert len(marked) == 1
    for i, (a, b) in enumerate(zip(exercise, solved)):
        if i in marked:
            assert b.source.startswith(SOLUTION_MARK)
            for obj in SOLVED[name]:  # the solved cell is the reference code, verbatim
                assert inspect.getsource(obj).strip() in b.source
            assert "raise NotImplementedError" in a.source and "TODO" in a.source
        else:
            assert (a.cell_type, a.source) == (b.cell_type, b.source), f"cell {i} differs"
    assert not any(c.get("outputs") for c in exercise if c.cell_type == "code")


@pytest.mark.parametrize("name", NAMES)
def test_notebooks_match_their_jupytext_pairs(name):
    jupytext = pytest.importorskip("jupytext")
    for path in (LABS / f"{name}.ipynb", LABS / "solutions" / f"{name}.ipynb"):
        paired = jupytext.read(path.with_suffix(".py"))
        assert [c.source for c in paired.cells if c.cell_type == "code"] == _code_cells(path)


@pytest.mark.parametrize("name", NAMES)
def test_exercise_notebooks_run_and_the_grader_says_not_implemented(name):
    namespace: dict = {"__name__": "__lab__"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for source in _code_cells(LABS / f"{name}.ipynb"):
            try:
                exec(compile(source, f"<{name}>", "exec"), namespace)
            except NotImplementedError:  # "try it" cells call the skeleton
                pass
    assert namespace["result"].not_implemented
    assert "not implemented yet" in out.getvalue()
