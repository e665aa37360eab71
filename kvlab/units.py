"""Small arithmetic helpers written once: ceiling division, rounding, byte sizes."""

from __future__ import annotations

import re

MiB = 1 << 20
GiB = 1 << 30
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}  # fmt: skip


def ceil_div(n: int, d: int) -> int:
    """The smallest integer >= n / d (positive d)."""
    return -(-n // d)


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of `multiple` >= n."""
    return ceil_div(n, multiple) * multiple


def parse_size(text: str | int | float) -> int:
    """Bytes from "80GiB", "24GB", "512MiB", "1.5e9" or a number (GB = 1e9, GiB = 2**30)."""
    if isinstance(text, int | float):
        return int(text)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"size {text!r} is not understood: give a number with an optional unit "
            "(B, KB, MB, GB, TB = powers of 1000; KiB, MiB, GiB, TiB = powers of 1024)"
        )
    return int(float(match.group(1)) * _UNITS[unit])
