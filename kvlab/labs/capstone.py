"""Lab 10 grader, the capstone: the learner's parts from labs 1, 2 and 4 inside kvlab's
engine, serving the real model.

`plug_in(engine, make_allocator, block_keys, choose_victim)` puts them where kvlab's own
parts sit in an engine that has served nothing yet: the allocator into its `PagedCache`
(`cache.allocator`, called back through the cache's own `on_evict`), the block hash into
its hash prefix index (`cache.index`: kvlab's `HashPrefixIndex` with the learner's keys)
and the victim rule into its scheduler (`Scheduler.choose_victim`).

The grader serves a multi-turn, shared-prefix workload (`capstone_workload`: users asking
about one document, in waves, under a KV budget tight enough to evict and preempt) on one
model twice, once with the learner's parts and once with kvlab's own, and compares request
by request: the greedy tokens, the prompt tokens served from the prefix cache and the
preemptions; the cache must be consistent after every step and every block free or cached
once all requests finished. kvlab's own engine is the reference: each of its tokens is checked
here to be HF transformers' greedy pick (the argmax of HF's logits over the same prefix) on
every request of the notebook's workload, and kvlab's greedy tokens and
prefix hits equal vLLM's on the oracle's shared-prefix workloads
(tests/test_vllm_oracle.py::test_greedy_tokens_identical and ::test_prefix_hit_tokens_per_request;
no vLLM tokens are stored for this workload, and the grader never runs vLLM). On a failure the
grader drops requests while the same check still fails, and shows the smallest workload found.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field, replace

import torch

from kvlab import texts
from kvlab.build import Engine
from kvlab.cache import BlockAllocator, OutOfBlocks, PagedCache
from kvlab.config import EngineConfig, SamplingParams
from kvlab.engine.scheduler import choose_victim as kvlab_choose_victim
from kvlab.integrity import IntegrityError
from kvlab.labs import kv_cache
from kvlab.labs.grading import SEED_STRIDE, Broken, Case, LabResult, grade, shrink
from kvlab.labs.hashing import _LearnerIndex, kvlab_block_keys
from kvlab.labs.victim import running_seq
from kvlab.model.loading import LoadedModel
from kvlab.multiturn import first_turn_ids, next_turn_ids

MakeAllocator = Callable[..., object]  # (num_blocks, on_evict) -> allocator; a class will do
KeysFn = Callable[[list[int], int, "str | None"], list[Hashable]]
ChooseVictim = Callable[[list], object]

BLOCK_SIZE = 16  # tokens per block (vLLM's default)
NUM_BLOCKS = 26  # the KV budget: too few for every conversation, so blocks are evicted
DOCUMENT = "doc01_library_rules"  # the document every user asks about (kvlab.texts)
SHRINK_TRIES = 12  # smaller workloads tried (two engine runs each) on a failure

TOKENS = "every request's greedy tokens equal kvlab's engine's (HF transformers' greedy picks)"
HITS = "every request is served as many prompt tokens from the prefix cache as with kvlab's parts"
PREEMPTIONS = "the same requests are preempted as often as with kvlab's victim rule"
LEAKS = "when every request has finished, every block is free or cached again"
CONSISTENT = "no engine rule breaks: PagedCache.check_integrity() holds after every step"


@dataclass(frozen=True)
class CapstoneRequest:
    """One request of the workload: the requests of a wave arrive together, once every
    request of the wave before has finished."""

    name: str  # "a2": user a's second turn
    wave: int
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    priority: int = 0
    salt: str | None = None
    why: str = ""  # what it exercises


@dataclass(frozen=True)
class Served:
    """What the engine did for one request."""

    tokens: tuple[int, ...]
    hit_tokens: int
    preemptions: int
    error: str | None


@dataclass
class Run:
    """One serve of a workload: per request what happened, and the cache along the way."""

    served: dict[str, Served] = field(default_factory=dict)
    names: dict[int, str] = field(default_factory=dict)  # engine request id -> name
    broke: str | None = None  # the first engine rule that broke, where (the serve stops)
    wrong_victim: str | None = None  # the first victim choice unlike kvlab's rule
    leaked: str | None = None  # blocks neither free nor cached at the end, or None


def capstone_model() -> LoadedModel:
    """The model the capstone serves: the embedded SmolLM2-135M on the CPU in float32
    (loaded once per process)."""
    return kv_cache._model()


def capstone_config(num_blocks: int = NUM_BLOCKS) -> EngineConfig:
    """The engine the capstone serves on: paged, hash prefix caching, a small KV budget."""
    return EngineConfig(
        cache="paged",
        block_size=BLOCK_SIZE,
        prefix_caching="hash",
        kv_budget_tokens=num_blocks * BLOCK_SIZE,
        max_model_len=512,
    )


def plug_in(engine, make_allocator: MakeAllocator, block_keys: KeysFn, choose_victim) -> None:
    """Put the learner's allocator, block hash and victim rule into `engine`, in place of
    kvlab's own (an engine with cache="paged" and prefix_caching="hash", before its first
    request)."""
    cache = engine.cache
    if not isinstance(cache, PagedCache) or engine.config.prefix_caching != "hash":
        raise ValueError("plug_in needs an engine with cache='paged' and prefix_caching='hash'")
    if cache.tables or cache.allocator.num_cached or cache.allocator.num_used:
        raise ValueError("plug_in needs an engine that has not served a request yet")
    cache.allocator = make_allocator(cache.num_blocks, on_evict=cache.allocator.on_evict)
    cache.index = _LearnerIndex(cache.block_size, block_keys)
    engine.scheduler.choose_victim = choose_victim


KVLAB_PARTS = (BlockAllocator, kvlab_block_keys, kvlab_choose_victim)


def _watched(choose_victim: ChooseVictim, run: Run) -> ChooseVictim:
    """The learner's victim rule, noting the first choice kvlab's rule would not make."""

    def choose(running: list) -> object:
        want = kvlab_choose_victim(list(running))
        victim = choose_victim(running)
        if victim is not want and run.wrong_victim is None:
            seqs = ", ".join(
                f"{run.names.get(s.request_id, s.request_id)} (priority {s.priority}, "
                f"admit_order {s.admit_order})"
                for s in running
            )
            chose = getattr(victim, "request_id", victim)
            run.wrong_victim = (
                f"running [{seqs}]: your choose_victim chose {run.names.get(chose, chose)}, "
                f"kvlab's rule chooses {run.names[want.request_id]}"
            )
        return victim

    return choose


def serve(model: LoadedModel, requests: list[CapstoneRequest], parts=KVLAB_PARTS) -> Run:
    """Serve `requests` wave by wave on a fresh engine with `parts` plugged in."""
    run = Run()
    make_allocator, block_keys, choose_victim = parts
    engine = Engine(model, capstone_config())
    plug_in(engine, make_allocator, block_keys, _watched(choose_victim, run))
    return _serve_on(engine, requests, run)


def _serve_on(engine, requests: list[CapstoneRequest], run: Run) -> Run:
    """Serve `requests` wave by wave on `engine`, into `run`. An engine rule that breaks
    (an IntegrityError, an AssertionError of `check_integrity()` after a step, or
    OutOfBlocks where the cache counted a block available) is noted in `run.broke` and
    ends the serve."""
    for wave in sorted({r.wave for r in requests}):
        for r in (r for r in requests if r.wave == wave):
            params = SamplingParams(max_new_tokens=r.max_new_tokens, ignore_eos=True)
            rid = engine.add_request(list(r.prompt_ids), params, salt=r.salt, priority=r.priority)
            run.names[rid] = r.name
        steps = 0
        while engine.has_unfinished() and run.broke is None:
            steps += 1
            try:
                for out in engine.step():
                    m = out.metrics
                    run.served[run.names[out.request_id]] = Served(
                        tuple(out.token_ids), m.prefix_hit_tokens, m.preemptions, out.error
                    )
                engine.cache.check_integrity()
            except (IntegrityError, AssertionError, OutOfBlocks) as error:
                run.broke = f"{type(error).__name__} in wave {wave}, step {steps}: {error}"
        if run.broke:
            return run
    allocator = engine.cache.allocator
    if allocator.num_used or any(allocator.ref_counts):
        held = [b for b, n in enumerate(allocator.ref_counts) if n]
        run.leaked = (
            f"num_used={allocator.num_used} (blocks with references: {held}), "
            f"num_free={allocator.num_free}, num_cached={allocator.num_cached} "
            f"of {engine.cache.num_blocks} blocks"
        )
    return run


# --- the workload ---------------------------------------------------------------------------
def _check_against_hf(model: LoadedModel, request: CapstoneRequest, tokens: tuple) -> None:
    """kvlab's engine, the reference, chose HF transformers' greedy token at every step:
    one forward of HF's model over the prompt and kvlab's answer, each answer token the
    argmax of the logits before it (what HF's greedy `generate` picks, in one pass)."""
    ids = torch.tensor([[*request.prompt_ids, *tokens]])  # (1, prompt + answer tokens)
    with torch.no_grad():
        logits = model.hf_model(ids).logits[0]  # (tokens, vocab)
    start = len(request.prompt_ids)
    hf = logits[start - 1 : -1].argmax(-1).tolist()
    if hf != list(tokens):
        raise RuntimeError(
            f"kvlab's engine and HF transformers disagree on request {request.name}: "
            f"{list(tokens)} != {hf} (the reference itself is broken)"
        )


@dataclass
class Reference:
    """The workload of one seed and kvlab's own serve of it (checked against HF)."""

    requests: list[CapstoneRequest]
    run: Run


def capstone_workload(model: LoadedModel, seed: int = 0, check_hf: bool = True) -> Reference:
    """Users a, b, c ask about one document over three turns; each turn's prompt is the
    conversation so far (kvlab's answers) and a new question, so later turns find their
    history in the prefix cache. One engine with kvlab's own parts serves the waves as they
    are made: that serve is the reference (`check_hf`: each request's tokens are checked
    against HF transformers' greedy choices).

    wave 0: a1, b1, c1, and x1: a1's prompt from another tenant (a salt);
    wave 1: a2, b2, c2 (priorities drawn; long answers: the budget runs out and requests
            are preempted), and y1: a1's prompt without its second block (each later block
            one position earlier: it must not hit a1's blocks);
    wave 2: a3, and b1 asked again (are its blocks still cached?).
    """
    rng = random.Random(SEED_STRIDE * seed + 10)
    tok = model.tokenizer
    asked = rng.sample(texts.questions(), 7)
    priorities = rng.choice([(0, 1, 0), (1, 0, 0), (0, 0, 1), (1, 1, 0)])
    opening = f"Here is a document.\n\n{texts.documents()[DOCUMENT]}\n\nQuestion: "
    first = [tuple(first_turn_ids(tok, opening + q)) for q in asked[:3]]
    a1 = first[0]
    wave0 = [CapstoneRequest(f"{u}1", 0, ids, 8, why="first turn") for u, ids in zip("abc", first)]
    wave0.append(CapstoneRequest("x1", 0, a1, 8, salt="tenant-x", why="a1, another tenant"))
    engine = Engine(model, capstone_config())
    plug_in(engine, *KVLAB_PARTS)
    run = _serve_on(engine, wave0, Run())

    def next_turn(r: CapstoneRequest, question: str) -> tuple[int, ...]:
        answer = list(run.served[r.name].tokens)
        if answer[-1] != tok.eos_token_id:  # the answer ends its turn (kvlab.multiturn)
            answer.append(tok.eos_token_id)
        return tuple(next_turn_ids(tok, list(r.prompt_ids) + answer, question))

    wave1 = [
        CapstoneRequest(
            f"{u}2", 1, next_turn(r, asked[3 + i]), 32, priorities[i], why="second turn"
        )
        for i, (u, r) in enumerate(zip("abc", wave0))
    ]
    skipped = a1[:BLOCK_SIZE] + a1[2 * BLOCK_SIZE :]
    wave1.append(CapstoneRequest("y1", 1, skipped, 8, why="a1 without its second block"))
    _serve_on(engine, wave1, run)
    wave2 = [
        CapstoneRequest("a3", 2, next_turn(wave1[0], asked[6]), 8, why="third turn"),
        replace(wave0[1], name="b1-again", wave=2, why="b1 asked again"),
    ]
    _serve_on(engine, wave2, run)
    requests = wave0 + wave1 + wave2
    if run.broke or len(run.served) != len(requests):
        raise RuntimeError(f"kvlab's own engine did not serve the workload: {run.broke}")
    if check_hf:
        for r in requests:
            _check_against_hf(model, r, run.served[r.name].tokens)
    return Reference(requests, run)


# --- the checks -----------------------------------------------------------------------------
def _describe(requests: list[CapstoneRequest], seed: int) -> str:
    """The requests, a line each, then the call that serves only them (to paste and run)."""
    lines = []
    for r in requests:
        extra = "".join(
            [
                f", priority {r.priority}" if r.priority else "",
                f", salt {r.salt!r}" if r.salt else "",
            ]
        )
        lines.append(
            f"wave {r.wave}: {r.name:<8} {len(r.prompt_ids)} prompt tokens, "
            f"{r.max_new_tokens} new{extra}  # {r.why}"
        )
    names = [r.name for r in requests]
    seeded = f", seed={seed}" if seed else ""
    lines.append(
        f"check_capstone(make_allocator, block_keys, choose_victim, requests={names}{seeded})"
    )
    return "\n".join(lines)


def _missing(run: Run, requests: list[CapstoneRequest]) -> None:
    """A request the serve never finished: it stopped where an engine rule broke (the
    broken rule is the failure, so a smaller workload that breaks one does not stand in for
    another check's failure)."""
    for r in requests:
        if r.name not in run.served:
            raise Broken(
                CONSISTENT, f"request {r.name} never finished: {run.broke}", "every request served"
            )


def _consistent(run: Run, ref: Run, requests: list[CapstoneRequest]) -> None:
    if run.broke:
        hint = "read the rule that broke: reference counts and block states are lab 1's"
        if run.broke.startswith("OutOfBlocks"):
            hint = (
                "allocate() raised OutOfBlocks where the cache counted a free or cached "
                "block: every block whose last reference is dropped must be reusable (lab 1)"
            )
        if "salt" in run.broke:
            hint = "requests of different salts shared a block: block_keys must hash the salt"
        if run.wrong_victim:
            hint = f"the victim rule (lab 4): {run.wrong_victim}"
        raise Broken(CONSISTENT, run.broke, "no engine rule breaks", hint)


def _tokens(run: Run, ref: Run, requests: list[CapstoneRequest]) -> None:
    _missing(run, requests)
    for r in requests:
        got, want = run.served[r.name], ref.served[r.name]
        if got.error:
            raise Broken(TOKENS, f"request {r.name} failed: {got.error}", f"{list(want.tokens)}")
        if got.tokens != want.tokens:
            i = next(i for i, (x, y) in enumerate(zip(got.tokens, want.tokens)) if x != y)
            hint = (
                f"it read K/V that its own prefix did not write ({got.hit_tokens} prompt tokens "
                f"from the cache, with kvlab's parts {want.hit_tokens}): does block_keys chain "
                "each block to its parent's key (lab 2), and is a block in use never handed "
                "out again (lab 1)?"
            )
            raise Broken(
                TOKENS,
                f"request {r.name}: {list(got.tokens)} (the first difference at token {i})",
                f"{list(want.tokens)}",
                hint,
            )


def _hits(run: Run, ref: Run, requests: list[CapstoneRequest]) -> None:
    _missing(run, requests)
    got = {r.name: run.served[r.name].hit_tokens for r in requests}
    want = {r.name: ref.served[r.name].hit_tokens for r in requests}
    if got != want:
        name = next(n for n in got if got[n] != want[n])
        if got[name] > want[name]:
            hint = (
                f"{name} was served blocks kvlab's keys do not match: a block's key must "
                "chain its parent's key and hash the salt (lab 2)"
            )
        else:
            hint = (
                f"blocks {name} found cached with kvlab's parts were gone: does "
                "decref(block, keep_cached=True) keep the block, does allocate() take free "
                "blocks first and evict the least recently used cached one (lab 1)?"
            )
        raise Broken(HITS, f"prompt tokens from the cache per request: {got}", f"{want}", hint)


def _preemptions(run: Run, ref: Run, requests: list[CapstoneRequest]) -> None:
    if run.wrong_victim:
        raise Broken(
            PREEMPTIONS,
            run.wrong_victim,
            "kvlab's choice: the lowest priority, then the most recently admitted (lab 4)",
            "a larger priority is more important; admit_order counts admissions",
        )
    _missing(run, requests)
    got = {r.name: run.served[r.name].preemptions for r in requests}
    want = {r.name: ref.served[r.name].preemptions for r in requests}
    if got != want:
        raise Broken(
            PREEMPTIONS,
            f"preemptions per request: {got}",
            f"{want}",
            "blocks ran out at other times than with kvlab's parts: is a block lost (lab 1)?",
        )


def _leaks(run: Run, ref: Run, requests: list[CapstoneRequest]) -> None:
    _missing(run, requests)
    if run.leaked:
        raise Broken(
            LEAKS,
            run.leaked,
            "num_used=0: every block free or cached",
            "a block whose last reference is dropped goes back on the free list, or into "
            "`cached` with keep_cached=True, every time (lab 1)",
        )


LAB = "Capstone: your parts in kvlab's engine"
CHECKS = [
    ("the engine's rules hold after every step", _consistent),
    ("greedy tokens equal the reference", _tokens),
    ("preemptions per request equal kvlab's", _preemptions),
    ("prefix-cache hits per request equal kvlab's", _hits),
    ("no leaked blocks at the end", _leaks),
]
# (id(model), seed) -> (model, its reference): the model kept alive, so its id stays its own
_REFERENCES: dict[tuple[int, int], tuple[LoadedModel, Reference]] = {}


def reference(model: LoadedModel, seed: int = 0) -> Reference:
    """The workload of `seed` and kvlab's own serve of it (computed once per model). The
    notebook's workload (seed 0) is checked against HF transformers too; another seed's
    (the hidden tests') is not: the same engine on other questions."""
    key = (id(model), seed)
    if key not in _REFERENCES:
        _REFERENCES[key] = model, capstone_workload(model, seed, check_hf=seed == 0)
    return _REFERENCES[key][1]


def check_capstone(
    make_allocator: MakeAllocator,
    block_keys: KeysFn,
    choose_victim: ChooseVictim,
    verbose: bool = True,
    raise_on_failure: bool = False,
    seed: int = 0,
    model: LoadedModel | None = None,
    requests: list[str] | None = None,
) -> LabResult:
    """Grade the parts of labs 1, 2 and 4 inside kvlab's engine (notebook 10_capstone).

    `make_allocator(num_blocks, on_evict)` makes a block allocator (lab 1's class will do),
    `block_keys(tokens, block_size, salt)` is lab 2's hash, `choose_victim(running)` lab
    4's rule. `model`: the model to serve (default: the embedded SmolLM2-135M). `seed`
    draws another workload (other questions and priorities: the hidden tests');
    `requests` keeps only the requests of those names (a failure's smallest workload).
    """
    parts = (make_allocator, block_keys, choose_victim)
    pending = _not_implemented(parts)
    if pending is not None:  # a stub: say so at once, without serving the workload
        return grade(
            LAB, [(name, _raiser(pending)) for name, _ in CHECKS], verbose, raise_on_failure
        )
    model = model or capstone_model()
    ref = reference(model, seed)
    every = [r for r in ref.requests if requests is None or r.name in requests]
    runs: dict[tuple[str, ...], tuple[Run, Run]] = {}
    crashed: list[BaseException] = []

    def both(names: tuple[str, ...]) -> tuple[Run, Run]:
        if names not in runs:
            subset = [r for r in every if r.name in names]
            kvlab_run = ref.run if len(subset) == len(ref.requests) else serve(model, subset)
            runs[names] = (serve(model, subset, parts), kvlab_run)
        return runs[names]

    def run_case(check, case: Case) -> None:
        subset = [r for r in every if r.name in case.ops]
        run, kvlab_run = both(case.ops)
        try:
            check(run, kvlab_run, subset)
        except Broken as broken:
            broken.example = _describe(subset, seed)
            raise

    shrunk: list[bool] = []  # only the first failure is shown in full: shrink only it

    def graded(check) -> Callable[[], None]:
        def run() -> None:
            if crashed:
                raise crashed[0]
            case = Case((), tuple(r.name for r in every))
            try:
                run_case(check, case)
            except Broken as broken:
                if shrunk:
                    raise
                shrunk.append(True)
                _, smallest = shrink(
                    case, broken, lambda c: run_case(check, c), budget=SHRINK_TRIES
                )
                raise smallest from None
            except NotImplementedError:
                raise
            except Exception as error:
                crashed.append(error)
                raise

        return run

    checks = [(name, graded(check)) for name, check in CHECKS]
    return grade(LAB, checks, verbose, raise_on_failure)


def _not_implemented(parts: tuple) -> NotImplementedError | None:
    """The NotImplementedError a part raises on a first small call (a lab's stub), if any."""
    make_allocator, block_keys, choose_victim = parts
    calls = (
        lambda: make_allocator(4, on_evict=None),
        lambda: block_keys([1, 2, 3, 4], 2, None),
        lambda: choose_victim([running_seq(0), running_seq(1, admit_order=2)]),
    )
    for call in calls:
        try:
            call()
        except NotImplementedError as error:
            return error
        except Exception:  # a crash: the checks report it where it happens
            pass
    return None


def _raiser(error: BaseException) -> Callable[[], None]:
    def check() -> None:
        raise error

    return check
