"""Invariant checks that say which rule broke, and survive `python -O` (unlike `assert`)."""

from __future__ import annotations


class IntegrityError(RuntimeError):
    """An engine invariant does not hold; the message names the rule that broke."""


def require(condition: bool, rule: str) -> None:
    """Raise IntegrityError(rule) unless `condition` holds."""
    if not condition:
        raise IntegrityError(rule)


class EngineDead(RuntimeError):
    """The engine cannot go on (a worker process died, an invariant broke mid-step); the
    message names the cause. Every unfinished request is lost; no later call will help."""
