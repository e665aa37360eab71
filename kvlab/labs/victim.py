"""Lab 4 grader: which running request to preempt when the KV blocks run out.

`choose_victim(running)` gets the scheduler's running sequences (kvlab `Sequence`s) and
returns the one to preempt. kvlab's rule: the lowest priority first (a larger `priority`
is more important), then the most recently admitted (the largest `admit_order`): it has
the least work to lose, and the requests admitted first keep making progress. The
grader's reference is kvlab's real victim rule, `kvlab.engine.scheduler.choose_victim`.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from kvlab.config import SamplingParams
from kvlab.engine.scheduler import choose_victim
from kvlab.labs.grading import SEED_STRIDE, Broken, Case, LabResult, grade, search
from kvlab.sequence import RequestState, Sequence

ChooseVictim = Callable[[list[Sequence]], Sequence]

RETURNS_ONE = "the victim is one of the running sequences (the object itself)"
UNCHANGED = "choose_victim leaves the running list as it was (the scheduler removes the victim)"
PRIORITY = "a lower-priority request is preempted before any higher-priority one"
NEWEST = "among equal priorities, the most recently admitted (largest admit_order) goes first"
ORDER_FREE = "the choice does not depend on the order of the running list"
LIKE_KVLAB = "the same victim as kvlab's Scheduler"


def running_seq(
    request_id: int,
    priority: int = 0,
    admit_order: int = 1,
    arrival_s: float = 0.0,
    num_computed: int = 32,
) -> Sequence:
    """A running kvlab Sequence with the fields the victim choice may look at."""
    seq = Sequence(
        request_id,
        [1] * max(num_computed, 1),
        SamplingParams(max_new_tokens=16),
        arrival_s=arrival_s,
        priority=priority,
    )
    seq.admit_order, seq.num_computed, seq.status = (
        admit_order,
        num_computed,
        RequestState.RUNNING,
    )
    return seq


def _code(seq: Sequence) -> str:
    return (
        f"running_seq({seq.request_id}, priority={seq.priority}, admit_order={seq.admit_order}, "
        f"arrival_s={seq.arrival_s}, num_computed={seq.num_computed})"
    )


def _example(running: list[Sequence], fn: ChooseVictim) -> str:
    lines = ["from kvlab.labs import running_seq", "running = ["]
    lines += [f"    {_code(seq)}," for seq in running]
    lines += ["]", f"victim = {fn.__name__}(running)"]
    return "\n".join(lines)


def _describe(seq: Sequence) -> str:
    return (
        f"request {seq.request_id} (priority {seq.priority}, admit_order {seq.admit_order}, "
        f"arrival_s {seq.arrival_s})"
    )


def kvlab_victim(running: list[Sequence]) -> Sequence:
    """The sequence kvlab's Scheduler preempts when it needs one block and none is free."""
    return choose_victim(running)


def _ask(fn: ChooseVictim, running: list[Sequence]) -> Sequence:
    before = list(running)
    states = [(s.priority, s.admit_order, s.num_computed) for s in running]
    victim = fn(running)
    if (
        running != before
        or [(s.priority, s.admit_order, s.num_computed) for s in running] != states
    ):
        raise Broken(
            UNCHANGED,
            f"after the call, running holds requests {[s.request_id for s in running]}",
            f"requests {[s.request_id for s in before]}, unchanged",
            "return the victim; don't pop or remove it (Scheduler.preempt does that)",
            _example(before, fn),
        )
    if not any(victim is seq for seq in running):
        hint = ""
        if isinstance(victim, int):
            hint = "return the Sequence itself, not its index or request_id"
        raise Broken(
            RETURNS_ONE,
            f"{fn.__name__}(running) returned {victim!r}"[:200],
            "one of the Sequence objects in running",
            hint,
            _example(running, fn),
        )
    return victim


def _expect(fn: ChooseVictim, running: list[Sequence], invariant: str, why: str) -> None:
    victim = _ask(fn, running)
    want = kvlab_victim(running)
    if victim is not want:
        hint = ""
        if victim.priority > want.priority:
            hint = (
                "in kvlab a larger `priority` is more important (vLLM's convention is the "
                "reverse): preempt the smallest priority value"
            )
        elif victim.arrival_s > want.arrival_s and victim.admit_order < want.admit_order:
            hint = (
                "admit_order counts admissions: a preempted request gets a new one when it "
                "is admitted again, while arrival_s never changes"
            )
        elif invariant == NEWEST:
            hint = (
                "preempting the request admitted first would throw away the most work, and "
                "it could be preempted again and again (starve)"
            )
        raise Broken(
            invariant,
            f"chose {_describe(victim)}",
            f"{_describe(want)}: {why}",
            hint,
            _example(running, fn),
        )


def _check_returns_one(fn: ChooseVictim) -> None:
    _ask(fn, [running_seq(0)])
    _ask(fn, [running_seq(i, admit_order=i + 1) for i in range(3)])


def _check_priority(fn: ChooseVictim) -> None:
    cases = [
        [running_seq(0, priority=0, admit_order=1), running_seq(1, priority=1, admit_order=2)],
        [running_seq(0, priority=1, admit_order=1), running_seq(1, priority=0, admit_order=2)],
        [
            running_seq(0, priority=-1, admit_order=1, arrival_s=0.0),
            running_seq(1, priority=2, admit_order=2, arrival_s=0.1),
            running_seq(2, priority=0, admit_order=3, arrival_s=0.2),
        ],
    ]
    for running in cases:
        _expect(fn, running, PRIORITY, "the lowest priority goes first, however recent")


def _check_newest(fn: ChooseVictim) -> None:
    cases = [
        [
            running_seq(0, admit_order=1, arrival_s=0.0),
            running_seq(1, admit_order=2, arrival_s=0.5),
        ],
        [  # request 0 arrived first, was preempted, and came back after request 1
            running_seq(0, admit_order=3, arrival_s=0.0, num_computed=8),
            running_seq(1, admit_order=2, arrival_s=0.4, num_computed=48),
        ],
        [
            running_seq(5, admit_order=7, arrival_s=1.0, num_computed=100),
            running_seq(6, admit_order=4, arrival_s=1.2, num_computed=10),
            running_seq(7, admit_order=6, arrival_s=0.2, num_computed=60),
        ],
    ]
    for running in cases:
        _expect(fn, running, NEWEST, "it was admitted last, so it has the least work to lose")


def _check_order_free(fn: ChooseVictim, seed: int = 0) -> None:
    base = [
        running_seq(0, priority=0, admit_order=2),
        running_seq(1, priority=1, admit_order=5),
        running_seq(2, priority=0, admit_order=4),
        running_seq(3, priority=1, admit_order=1),
    ]
    rng = random.Random(3 + SEED_STRIDE * seed)
    first = _ask(fn, base)
    for _ in range(10):
        shuffled = rng.sample(base, len(base))
        victim = _ask(fn, shuffled)
        if victim is not first:
            raise Broken(
                ORDER_FREE,
                f"the same requests in another order: {_describe(first)}, then {_describe(victim)}",
                "the same victim: choose by priority and admit_order, not by position",
                "",
                _example(shuffled, fn),
            )


def _cases(count: int, seed: int = 0) -> list[Case]:
    rng = random.Random(11 + SEED_STRIDE * seed)
    cases = []
    for _ in range(count):
        n = rng.randint(1, 8)
        orders = rng.sample(range(1, 3 * n + 1), n)
        seqs = tuple(
            (i, rng.choice([-1, 0, 0, 1, 2]), orders[i], round(rng.uniform(0, 2), 2))
            for i in range(n)
        )
        cases.append(Case((), seqs))
    return cases


def _run_random(fn: ChooseVictim, case: Case) -> None:
    if not case.ops:
        return
    running = [
        running_seq(i, priority=p, admit_order=a, arrival_s=t, num_computed=8 * (a % 5 + 1))
        for i, p, a, t in case.ops
    ]
    victim = _ask(fn, running)
    want = kvlab_victim(running)
    if victim is not want:
        raise Broken(
            LIKE_KVLAB,
            f"chose {_describe(victim)}",
            f"{_describe(want)}: lowest priority first, then the largest admit_order",
            "",
            _example(running, fn),
        )


def check_victim_choice(
    fn: ChooseVictim, verbose: bool = True, raise_on_failure: bool = False, seed: int = 0
) -> LabResult:
    """Grade `choose_victim(running: list[Sequence]) -> Sequence` (notebook 04).

    `seed` (default 0, the cases the notebook shows) draws other random cases for the same
    checks: the lab sources' hidden tests grade with a seed the learner has not seen.
    """
    checks = [
        ("returns a running sequence", lambda: _check_returns_one(fn)),
        ("priorities", lambda: _check_priority(fn)),
        ("most recently admitted first", lambda: _check_newest(fn)),
        ("independent of list order", lambda: _check_order_free(fn, seed)),
        (
            "random running sets vs kvlab's Scheduler",
            lambda: search(_cases(300, seed), lambda case: _run_random(fn, case)),
        ),
    ]
    return grade("Preemption victim", checks, verbose, raise_on_failure)
