"""Exercises that check themselves: a prediction, a block table to fill, a policy to pick.

An exercise is a function registered under a key ("NN.name", NN the notebook) that computes
the right answer from the notebook's own objects; the notebook asks the learner for an
answer and calls `ask`, which compares and answers at once:

    @exercise("01.kv-bytes", question="...", solution="...", hint="...", example=...)
    def kv_bytes(model) -> int:
        return model.kv_bytes_per_token

    ask("01.kv-bytes", my_answer, model=model)   # Verdict: right / not yet + hint / unanswered

`ask` never raises on a wrong or missing answer (Run All goes on); it raises ValueError for
an unknown key or missing context, which are the notebook's bugs, not the learner's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

RIGHT, WRONG, UNANSWERED = "right", "not yet", "unanswered"


@dataclass(frozen=True)
class Verdict:
    """What `ask` found; shown as one line in the notebook, true when right."""

    status: str  # RIGHT, WRONG or UNANSWERED
    message: str

    def __bool__(self) -> bool:
        return self.status == RIGHT

    def __repr__(self) -> str:
        return self.message

    def _repr_markdown_(self) -> str:
        return self.message


@dataclass(frozen=True)
class Exercise:
    key: str  # "NN.name": NN is the notebook it belongs to
    question: str  # what the learner is asked, for the answer key
    solution: str  # the worked answer, for the answer key
    solve: Callable[..., Any]  # the notebook's objects -> the right answer
    hint: str | Callable[[Any, Any], str]  # or (answer, right) -> a hint for that answer
    example: Callable[[], dict]  # a context tests can build cheaply (keyword arguments of solve)
    tolerance: float = 0.0  # numbers: relative tolerance
    choices: tuple = ()  # a pick-one: the options the answer must be one of
    wrong: Callable[[Any], Any] | None = None  # the right answer -> a known-wrong one (tests)

    def known_wrong(self, right: Any) -> Any:
        """A wrong answer for the tests: the exercise's own, else another choice, else 2x+1."""
        if self.wrong is not None:
            return self.wrong(right)
        if self.choices:
            return next(c for c in self.choices if c != right)
        if isinstance(right, (int, float)) and not isinstance(right, bool):
            return 2 * right + 1
        raise ValueError(f"exercise {self.key} needs wrong= (its answer is {type(right).__name__})")

    def matches(self, answer: Any, right: Any) -> bool:
        answer, right = _plain(answer), _plain(right)
        if isinstance(right, float) or (self.tolerance and isinstance(right, int)):
            if not isinstance(answer, (int, float)) or isinstance(answer, bool):
                return False
            return math.isclose(answer, right, rel_tol=self.tolerance, abs_tol=1e-12)
        return _plain(answer) == _plain(right)


EXERCISES: dict[str, Exercise] = {}


def exercise(key: str, **fields) -> Callable[[Callable], Callable]:
    """Register the decorated function as the solver of exercise `key` (see `Exercise`)."""

    def add(solve: Callable) -> Callable:
        if key in EXERCISES:
            raise ValueError(f"exercise {key!r} is registered already")
        EXERCISES[key] = Exercise(key=key, solve=solve, **fields)
        return solve

    return add


def _plain(value: Any) -> Any:
    """Tuples and lists (nested) compare alike; so do numpy/torch scalars and Python's."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 1) == 0:
        return value.item()
    return value


def ask(key: str, answer: Any, **context) -> Verdict:
    """Check the learner's `answer` to exercise `key`, computing the right one from `context`
    (the notebook's objects the exercise names). None (or ...) means not answered yet."""
    if key not in EXERCISES:
        raise ValueError(f"no exercise {key!r}; known: {sorted(EXERCISES)}")
    ex = EXERCISES[key]
    if answer is None or answer is Ellipsis:
        return Verdict(
            UNANSWERED,
            f"✏️ **{key}**: not answered yet: write your answer above and run the cell again.",
        )
    if ex.choices and answer not in ex.choices:
        return Verdict(
            WRONG,
            f"✗ **{key}**: {answer!r} is not one of the options "
            f"{', '.join(map(repr, ex.choices))}.",
        )
    right = ex.solve(**context)
    if ex.matches(answer, right):
        return Verdict(RIGHT, f"✓ **{key}**: right ({answer!r}).")
    hint = ex.hint(answer, right) if callable(ex.hint) else ex.hint
    return Verdict(WRONG, f"✗ **{key}**: not yet ({answer!r}). Hint: {hint}")
