"""Step observers: code that watches the engine's steps subscribes here instead of
replacing `engine.step` or its forward.

    engine.observers.subscribe("after_step", lambda finished: audit.check(engine))

A step calls its observers at three named points, in subscription order:

- "before_schedule" ()                 the step starts, before the scheduler runs;
- "after_compute"   (batch, logits)    the forward ran: the rows that go on to
                                       post-processing and their logits (a row's
                                       `num_computed` not yet advanced);
- "after_step"      (finished,)        the step that ran a batch is over; `finished`
                                       are the requests it finished.

Observers read; they must not change the engine's state (the tenant audit, the step
profile, determinism's logit recording and the GPU check are the ones kvlab has). An
observer that raises fails the step, as the code it replaced did.
"""

from __future__ import annotations

from collections.abc import Callable

POINTS = ("before_schedule", "after_compute", "after_step")


class StepObservers:
    """The observers of one engine's steps, by point."""

    def __init__(self) -> None:
        self._at: dict[str, list[Callable]] = {point: [] for point in POINTS}

    def subscribe(self, point: str, fn: Callable) -> Callable[[], None]:
        """Call `fn` at `point` of every step from now on; returns the call that stops it."""
        if point not in self._at:
            raise ValueError(f"no step point {point!r}; the points: {', '.join(POINTS)}")
        self._at[point].append(fn)
        return lambda: self._at[point].remove(fn)

    def notify(self, point: str, *args) -> None:
        for fn in self._at[point]:
            fn(*args)
