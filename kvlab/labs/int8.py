"""Lab 3 grader: an int8 KV codec with one scale per token per KV head.

`quantize(x)` takes K or V of shape (T, H, D) and returns int8 codes (T, H, D) and scales
(T, H); `dequantize(q, scale)` returns float32 (T, H, D). The grader checks the codec's
error bound (|x - x_hat| <= s / 2 per element, s = amax / 127 of that token's head, the
bound kvlab's Int8 codec passes in tests/test_codecs.py) on tensors shaped like real K/V:
heads of very different sizes, outlier channels, zeros, magnitudes from 1e-20 to 1e30.
A failure is cut down to the smallest slice of the tensor that still fails. Last, the
learner's codec is compared with kvlab's `Int8` codec (`kvlab_quantize`/`kvlab_dequantize`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from kvlab.cache import KVSpec
from kvlab.cache.codecs import CODECS
from kvlab.labs.grading import SEED_STRIDE, Broken, LabResult, grade

Quantize = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
Dequantize = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

ROUNDING = 1 + 2**-8  # slack for a scale rounded to bf16, as in tests/test_codecs.py
SHAPES = "int8 codes shaped like x, one scale per token per head (T, H), float32 output"
BOUND = "|x - x_hat| <= s / 2 for every element, s = amax / 127 of its token and head"
RANGE = "codes use the symmetric range [-127, 127]"
ZEROS = "zeros come back exactly, and nothing is NaN (an all-zero head has amax 0)"
LIKE_KVLAB = "x_hat is within one step (s) of kvlab's Int8 codec"


def _tensor(seed: int, shape, heads=None, outlier=1.0, zeros=0.0, magnitude=1.0, decimals=2):
    """(T, H, D) K/V-like values: per-head sizes, an outlier channel, some exact zeros."""
    gen = torch.Generator().manual_seed(seed)
    t, h, d = shape
    x = torch.randn(t, h, d, generator=gen)
    if decimals is not None:
        x = (x * 10**decimals).round() / 10**decimals  # short numbers in the examples
    if heads is not None:
        x = x * torch.tensor(heads, dtype=torch.float32)[None, :, None]
    x[..., 0] *= outlier
    x = torch.where(torch.rand(t, h, d, generator=gen) < zeros, 0.0, x)
    return (x * magnitude).float()


def _kv_like(seed: int) -> list[torch.Tensor]:
    """The K/V-like cases, small first: the first failure is the easiest to read."""
    s = SEED_STRIDE * seed
    return [
        _tensor(s + 0, (1, 1, 4)),
        _tensor(s + 1, (1, 2, 4), heads=[1.0, 40.0]),
        _tensor(s + 2, (2, 3, 8), heads=[1.0, 0.02, 30.0], outlier=20.0),
        _tensor(s + 3, (3, 2, 32), zeros=0.3),
        _tensor(s + 4, (5, 3, 64), heads=[1.0, 10.0, 0.1], outlier=100.0),
        _tensor(s + 5, (4, 1, 96), decimals=None),
        *[_tensor(s + 10 + i, (7, 3, 64), heads=[1.0, 3.0, 0.3], decimals=None) for i in range(4)],
    ]


def _extremes(seed: int) -> list[torch.Tensor]:
    """Tiny to huge magnitudes: scales that underflow or overflow narrow floats."""
    return [
        _tensor(SEED_STRIDE * seed + 20 + i, (2, 2, 8), magnitude=m, decimals=None)
        for i, m in enumerate([1e-20, 1e-6, 1e6, 1e30])
    ]


CASES, EXTREMES = _kv_like(0), _extremes(0)


def _kvlab_codec(shape) -> object:
    """kvlab's Int8 codec (kvlab/cache/codecs/int8.py) for one layer of (T, H, D) K/V."""
    _, heads, dim = shape
    return CODECS["int8"](KVSpec(1, heads, dim), 0, torch.float32, torch.device("cpu"))


def kvlab_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """kvlab's Int8 codec's encode: (T, H, D) -> int8 codes (T, H, D), bf16 scales (T, H)."""
    q, scale = _kvlab_codec(x.shape).encode(x)
    return q, scale


def kvlab_dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """kvlab's Int8 codec's decode: codes (T, H, D) and scales (T, H) -> float32 (T, H, D)."""
    return _kvlab_codec(q.shape).decode([q, scale])


def _fmt(x: torch.Tensor) -> str:
    """x as a nested list literal, each value in the fewest digits float32 reads back."""

    def nest(values) -> str:
        if isinstance(values, list):
            return "[" + ", ".join(nest(v) for v in values) + "]"
        return str(np.float32(values))

    return nest(x.tolist())


def _run(quantize: Quantize, dequantize: Dequantize, x: torch.Tensor):
    q, scale = quantize(x.clone())
    return q, scale, dequantize(q, scale)


def _check_shapes(quantize: Quantize, dequantize: Dequantize) -> None:
    x = CASES[2]
    t, h, d = x.shape
    q, scale, x_hat = _run(quantize, dequantize, x)
    call = f"x = torch.randn{tuple(x.shape)}\nq, scale = {quantize.__name__}(x)"
    for name, value in (("q", q), ("scale", scale), ("x_hat", x_hat)):
        if not isinstance(value, torch.Tensor):
            raise Broken(SHAPES, f"{name} is a {type(value).__name__}", "a torch.Tensor", "", call)
    if q.dtype != torch.int8:
        raise Broken(
            SHAPES,
            f"q.dtype == {q.dtype}",
            "torch.int8: one byte per value is the point of the codec",
            "round, clamp, then q.to(torch.int8)",
            call,
        )
    if q.shape != x.shape:
        raise Broken(SHAPES, f"q.shape == {tuple(q.shape)}", f"{tuple(x.shape)}", "", call)
    if tuple(scale.shape) != (t, h):
        raise Broken(
            SHAPES,
            f"scale.shape == {tuple(scale.shape)}",
            f"({t}, {h}): one scale per token per KV head",
            "take amax over the last dim only, x.abs().amax(dim=-1): one shared scale lets a "
            "large head (or an outlier token) swamp the small ones",
            call,
        )
    if not scale.is_floating_point():
        raise Broken(SHAPES, f"scale.dtype == {scale.dtype}", "a float dtype", "", call)
    if x_hat.shape != x.shape or x_hat.dtype not in (torch.float32, torch.float64):
        raise Broken(
            SHAPES,
            f"x_hat has shape {tuple(x_hat.shape)} and dtype {x_hat.dtype}",
            f"shape {tuple(x.shape)}, dtype torch.float32",
            "q.float() * scale.float()[..., None]",
            f"{call}\nx_hat = {dequantize.__name__}(q, scale)",
        )


def _violation(x: torch.Tensor, x_hat: torch.Tensor):
    """(index, error, bound) of the worst element over its bound, or None."""
    s = x.double().abs().amax(-1, keepdim=True) / 127
    bound = (s * ROUNDING / 2).expand_as(x)
    err = (x_hat.double() - x.double()).abs()
    over = torch.where(torch.isnan(err), torch.inf, err - bound)
    if not bool((over > 0).any()):
        return None
    index = tuple(int(i) for i in torch.nonzero(over == over.max())[0])
    return index, float(err[index]), float(bound[index])


def _check_bound(quantize: Quantize, dequantize: Dequantize, cases: list[torch.Tensor]) -> None:
    for x in cases:
        _, _, x_hat = _run(quantize, dequantize, x)
        found = _violation(x, x_hat)
        if found is None:
            continue
        (t, h, d), _, _ = found
        amax_d = int(x[t, h].abs().argmax())
        channels = sorted({d, amax_d})
        for part in (  # the smallest slice that still fails
            x[t : t + 1, h : h + 1, channels],
            x[t : t + 1, h : h + 1],
            x[t : t + 1],
            x[:, h : h + 1],
            x,
        ):
            q, scale, x_hat = _run(quantize, dequantize, part)
            found = _violation(part, x_hat)
            if found is not None:
                raise _bound_failure(quantize, dequantize, part, q, scale, x_hat, found)


def _bound_failure(quantize, dequantize, x, q, scale, x_hat, found) -> Broken:
    (t, h, d), err, bound = found
    amax = float(x[t, h].abs().max())
    s = amax / 127
    example = (
        f"x = torch.tensor({_fmt(x)})  # shape {tuple(x.shape)}\n"
        f"q, scale = {quantize.__name__}(x)\n"
        f"x_hat = {dequantize.__name__}(q, scale)"
    )
    got = (
        f"x[{t}, {h}, {d}] = {float(x[t, h, d]):.6g} comes back as "
        f"{float(x_hat[t, h, d]):.6g}: error {err:.4g}"
        + (f" (code {int(q[t, h, d])})" if q.shape == x.shape else "")
    )
    expected = (
        f"error <= s / 2 = {bound:.4g}, with s = amax / 127 = {amax:.6g} / 127 = {s:.4g} "
        f"for token {t}, head {h}"
    )
    hint = ""
    if tuple(scale.shape) == tuple(x.shape[:2]):
        theirs = float(scale[t, h])
        if not s / ROUNDING**2 <= theirs <= s * ROUNDING**2:
            hint = f"your scale for token {t}, head {h} is {theirs:.4g}, not amax / 127 = {s:.4g}"
            if bool((scale == scale.flatten()[0]).all()) and scale.numel() > 1:
                hint += (
                    "; every token and head got the same scale: compute amax per token per "
                    "head, x.abs().amax(dim=-1)"
                )
            elif theirs == 0:
                hint += (
                    "; it underflowed to 0: keep scales in float32 (or bfloat16, which has "
                    "float32's range); float16 cannot hold a scale below ~6e-8 or above 65504"
                )
            elif theirs == float("inf"):
                hint += "; it overflowed: keep scales in float32 (or bfloat16)"
            elif theirs < s:
                hint += "; x / scale then passes 127 and overflows int8 (wraps around)"
    if not hint and err != err:
        hint = "x_hat is NaN: guard the division when amax is 0"
    elif not hint and err <= s * ROUNDING:
        hint = (
            "the error is over half a step but within one: round to nearest, "
            "(x / s).round(), before casting; .to(torch.int8) alone truncates toward zero"
        )
    elif not hint:
        hint = "the error is over a whole step: do the codes overflow int8 (clamp to +-127)?"
    return Broken(BOUND, got, expected, hint, example)


def _check_range(quantize: Quantize, dequantize: Dequantize, cases: list[torch.Tensor]) -> None:
    for x in cases:
        q, _, _ = _run(quantize, dequantize, x)
        low = int(q.min())
        if low < -127:
            index = tuple(int(i) for i in torch.nonzero(q == low)[0])
            raise Broken(
                RANGE,
                f"code {low} at {list(index)} (x = {float(x[index]):.6g})",
                "codes in [-127, 127], so +x and -x get codes of the same size",
                "with s = amax / 127, x / s lies in [-127, 127]; clamp(-127, 127) after "
                "rounding keeps it there",
                f"x = torch.tensor({_fmt(x[index[0] : index[0] + 1])})",
            )


def _check_zeros(quantize: Quantize, dequantize: Dequantize) -> None:
    x = _tensor(30, (3, 3, 8), zeros=0.3)
    x[1, 2] = 0.0  # an all-zero head
    x[2] = 0.0  # an all-zero token
    _, scale, x_hat = _run(quantize, dequantize, x)
    example = f"x = torch.tensor({_fmt(x)})  # token 1 head 2 and all of token 2 are zero"
    if not bool(torch.isfinite(x_hat).all()):
        index = tuple(int(i) for i in torch.nonzero(~torch.isfinite(x_hat))[0])
        raise Broken(
            ZEROS,
            f"x_hat{list(index)} is {float(x_hat[index])} (scale {float(scale.flatten()[0])}...)",
            "finite values; an all-zero head decodes to zeros",
            "amax = 0 gives s = 0 and 0 / 0 = NaN: divide by torch.where(s > 0, s, 1) "
            "and keep the stored scale 0",
            example,
        )
    if not bool((x_hat[x == 0] == 0).all()):
        index = tuple(int(i) for i in torch.nonzero((x == 0) & (x_hat != 0))[0])
        raise Broken(
            ZEROS,
            f"x{list(index)} = 0 comes back as {float(x_hat[index]):.6g}",
            "exactly 0: a symmetric code maps 0 to code 0",
            "use a symmetric scale (no zero point) and round to nearest",
            example,
        )


def _check_like_kvlab(
    quantize: Quantize, dequantize: Dequantize, cases: list[torch.Tensor]
) -> None:
    for x in cases:
        reference = kvlab_dequantize(*kvlab_quantize(x)).double()
        _, _, x_hat = _run(quantize, dequantize, x)
        step = x.double().abs().amax(-1, keepdim=True) / 127 * ROUNDING**2
        gap = (x_hat.double() - reference).abs() - step
        if bool((gap > 0).any()):
            index = tuple(int(i) for i in torch.nonzero(gap == gap.max())[0])
            raise Broken(
                LIKE_KVLAB,
                f"x{list(index)} = {float(x[index]):.6g}: yours {float(x_hat[index]):.6g}, "
                f"kvlab's int8 {float(reference[index]):.6g}",
                f"at most one step apart (s = {float(step[index[:2]]):.4g})",
                "both should be within s / 2 of x",
            )


def check_int8_codec(
    quantize: Quantize,
    dequantize: Dequantize,
    verbose: bool = True,
    raise_on_failure: bool = False,
    seed: int = 0,
) -> LabResult:
    """Grade an int8 codec: `quantize(x) -> (q, scale)`, `dequantize(q, scale) -> x_hat`.

    `seed` (default 0, the cases the notebook shows) draws other random cases for the same
    checks: the lab sources' hidden tests grade with a seed the learner has not seen.
    """
    cases, extremes = (CASES, EXTREMES) if seed == 0 else (_kv_like(seed), _extremes(seed))
    checks = [
        ("shapes and dtypes", lambda: _check_shapes(quantize, dequantize)),
        ("error bound on K/V-like tensors", lambda: _check_bound(quantize, dequantize, cases)),
        ("error bound from 1e-20 to 1e30", lambda: _check_bound(quantize, dequantize, extremes)),
        ("symmetric code range", lambda: _check_range(quantize, dequantize, cases + extremes)),
        ("zeros and all-zero heads", lambda: _check_zeros(quantize, dequantize)),
        ("agrees with kvlab's Int8 codec", lambda: _check_like_kvlab(quantize, dequantize, cases)),
    ]
    return grade("Int8 KV codec", checks, verbose, raise_on_failure)
