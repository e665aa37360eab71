"""Small arithmetic helpers written once: ceiling division and byte units."""

from __future__ import annotations

MiB = 1 << 20
GiB = 1 << 30


def ceil_div(n: int, d: int) -> int:
    """The smallest integer >= n / d (positive d)."""
    return -(-n // d)
