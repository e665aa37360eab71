"""The graders' common machinery: named checks, failures a learner can act on, shrinking.

A grader is a list of named checks. A check either passes or raises `Broken`: the
invariant it broke, what happened (`got`), what should have happened (`expected`), the
input it broke on (`example`, as code the learner can paste and run) and a hint. Random
checks (seeded, so every run sees the same cases) shrink a failing case before reporting
it: operations are dropped one chunk at a time while the same invariant still breaks, so
the example shown is small enough to follow by hand.
"""

from __future__ import annotations

import importlib.util
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_HERE = str(Path(__file__).parent)
_TORCH = importlib.util.find_spec("torch")
# torch's own frames: a learner's tensor call that fails is reported at the learner's line
_LIBRARIES = (str(Path(_TORCH.origin).parent),) if _TORCH and _TORCH.origin else ()


class Broken(Exception):
    """A check found a broken invariant (raised inside checks, turned into a `Failure`)."""

    def __init__(self, invariant: str, got: str, expected: str, hint: str = "", example: str = ""):
        super().__init__(invariant)
        self.invariant, self.got, self.expected = invariant, got, expected
        self.hint, self.example = hint, example


@dataclass(frozen=True)
class Failure:
    check: str  # the check's name
    invariant: str  # the rule that broke, in words
    got: str
    expected: str
    example: str = ""  # the (smallest found) input, as code
    hint: str = ""

    def report(self) -> str:
        lines = [f'FAILED check "{self.check}"', f"  Broken invariant: {self.invariant}"]
        if self.example:
            lines.append("  Smallest failing input found:")
            lines += ["      " + line for line in self.example.splitlines()]
        lines.append(f"  Got:      {self.got}")
        lines.append(f"  Expected: {self.expected}")
        if self.hint:
            lines.append(f"  Hint:     {self.hint}")
        return "\n".join(lines)


class LabFailure(AssertionError):
    """Raised by `LabResult.raise_for_failure` / `raise_for_check` (or a grader called with
    raise_on_failure); its message is the report of what failed."""

    def __init__(self, result: LabResult):
        super().__init__(result.report())
        self.result = result


@dataclass
class LabResult:
    """What a grader found: the checks it ran and the failures (empty when all passed)."""

    lab: str
    checks: list[str]
    failures: list[Failure] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def num_passed(self) -> int:
        return len(self.checks) - len(self.failures)

    @property
    def not_implemented(self) -> bool:
        return any(f.invariant == NOT_IMPLEMENTED for f in self.failures)

    def report(self) -> str:
        if self.passed:
            return f"{self.lab}: all {len(self.checks)} checks passed."
        if self.not_implemented:
            first = next(f for f in self.failures if f.invariant == NOT_IMPLEMENTED)
            return (
                f"{self.lab}: not implemented yet. {first.got}.\n"
                "Fill in the TODOs in the exercise cell, run it, then run the grader again."
            )
        if len(self.checks) == 1:  # one check's part of a result (raise_for_check)
            head = f'{self.lab}: check "{self.checks[0]}" failed.\n\n'
        else:
            head = f"{self.lab}: {self.num_passed} of {len(self.checks)} checks passed.\n\n"
        body = self.failures[0].report()
        others = [f'"{f.check}" ({f.invariant})' for f in self.failures[1:]]
        tail = ("\n\nAlso failing: " + "; ".join(others)) if others else ""
        return head + body + tail

    def raise_for_failure(self) -> None:
        """Raise `LabFailure` (the report as its message) if any check failed."""
        if not self.passed:
            raise LabFailure(self)

    def raise_for_check(self, check: str) -> None:
        """Raise `LabFailure` if the check named `check` failed; return None if it passed.

        One autograded nbgrader test cell per check is one line,
        `result.raise_for_check("allocate and free")`: the cell scores its points when the
        check passed, and its output (the feedback) is that check's report: the broken
        invariant, the smallest failing input, what was expected and a hint. A name the
        grader does not have raises ValueError, so a renamed check cannot pass unnoticed.
        """
        if check not in self.checks:
            raise ValueError(f"{self.lab} has no check named {check!r}; its checks: {self.checks}")
        failed = [f for f in self.failures if f.check == check]
        if failed:
            raise LabFailure(LabResult(self.lab, [check], failed))

    def __repr__(self) -> str:
        return (
            f"LabResult(lab={self.lab!r}, passed={self.passed}, "
            f"checks={len(self.checks)}, failures={len(self.failures)})"
        )


NOT_IMPLEMENTED = "the exercise is implemented"
# A grader's `seed` moves each of its random generators by this much: seed 0 draws the cases
# the notebook shows, seed 1 or more cases nobody has seen (the hidden tests' draws).
SEED_STRIDE = 1000


def where(error: BaseException) -> str:
    """The learner's line that raised (the last frame outside kvlab.labs and torch), if any."""
    every = traceback.extract_tb(error.__traceback__)
    frames = [f for f in every if _HERE not in f.filename and not f.filename.startswith(_LIBRARIES)]
    if not frames:  # raised by the grader itself
        f = every[-1] if every else None
        return f" (in the grader, {Path(f.filename).name} line {f.lineno})" if f else ""
    f = frames[-1]
    return f" (line {f.lineno}: {f.line})" if f.line else f" (line {f.lineno})"


def grade(
    lab: str,
    checks: list[tuple[str, Callable[[], None]]],
    verbose: bool = True,
    raise_on_failure: bool = False,
) -> LabResult:
    """Run every check; print a short report (or the first failure in detail)."""
    result = LabResult(lab, [name for name, _ in checks])
    for name, check in checks:
        try:
            check()
        except Broken as broken:
            result.failures.append(
                Failure(
                    name, broken.invariant, broken.got, broken.expected, broken.example, broken.hint
                )
            )
        except NotImplementedError as error:
            frames = traceback.extract_tb(error.__traceback__)
            what = f"{frames[-1].name}()" if frames else "the exercise"
            result.failures.append(
                Failure(name, NOT_IMPLEMENTED, f"{what} raised NotImplementedError", "code")
            )
        except Exception as error:  # the learner's code crashed: say where and how
            got = f"{type(error).__name__}: {error}{where(error)}"
            result.failures.append(Failure(name, "the code runs without crashing", got, "no error"))
    if verbose:
        print(result.report())
    if raise_on_failure:
        result.raise_for_failure()
    return result


# --- random cases and shrinking ------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """One random case: fixed parameters and a list of operations (each a tuple)."""

    params: tuple
    ops: tuple


def _fewer_ops(case: Case) -> Iterator[Case]:
    ops, n = case.ops, len(case.ops)
    size = n // 2
    while size >= 1:
        for start in range(0, n - size + 1, size):
            yield Case(case.params, ops[:start] + ops[start + size :])
        size //= 2


def shrink(
    case: Case,
    first: Broken,
    run: Callable[[Case], None],
    smaller_params: Callable[[tuple], Iterable[tuple]] = lambda params: (),
    budget: int = 400,
) -> tuple[Case, Broken]:
    """A smaller case breaking the same invariant: fewer operations, smaller parameters."""
    best, broken = case, first
    improved = True
    while improved and budget > 0:
        improved = False
        candidates = [Case(p, best.ops) for p in smaller_params(best.params)]
        for candidate in [*candidates, *_fewer_ops(best)]:
            budget -= 1
            try:
                run(candidate)
            except Broken as error:
                if error.invariant == broken.invariant:
                    best, broken, improved = candidate, error, True
                    break
            except Exception:  # a different crash: not the same failure, keep looking
                pass
            if budget <= 0:
                break
    return best, broken


def search(
    cases: Iterable[Case],
    run: Callable[[Case], None],
    smaller_params: Callable[[tuple], Iterable[tuple]] = lambda params: (),
) -> None:
    """Run every case; on the first that breaks an invariant, shrink it and re-raise."""
    for case in cases:
        try:
            run(case)
        except Broken as broken:
            _, smallest = shrink(case, broken, run, smaller_params)
            raise smallest from None


class Transcript:
    """The calls a check made, as code the learner can paste into a cell and run."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.pending = ""  # the call being made, logged if it crashes

    def add(self, code: str, result: Any = None, note: str = "") -> None:
        comment = []
        if result is not None:
            comment.append(f"-> {result!r}")
        if note:
            comment.append(note)
        self.lines.append(f"{code:<34} # {'; '.join(comment)}" if comment else code)

    def text(self) -> str:
        return "\n".join(self.lines)

    def broken(self, invariant: str, got: str, expected: str, hint: str = "") -> Broken:
        return Broken(invariant, got, expected, hint, self.text())
