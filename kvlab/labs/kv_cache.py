"""Lab 0 grader: the KV cache of one attention layer.

The learner's class holds one attention layer's cached K and V, and attends over them:

    cache = LabKVCache(num_heads, num_kv_heads, head_dim, dtype)
    cache.k, cache.v      (T, num_kv_heads, head_dim): every token appended so far, in order
    cache.append(k, v)    the n new tokens' K and V, each (n, num_kv_heads, head_dim)
    cache.attend(q)       q: the queries of the last n tokens appended, (n, num_heads,
                          head_dim) -> their attention output, (n, num_heads, head_dim)

`attend` is softmax(q k^T / sqrt(head_dim)) v over every cached token, causal within the
append (the new tokens are the last n of the T cached: query i, at position T - n + i, sees
positions 0 .. T - n + i), each query head h reading KV head h // (num_heads //
num_kv_heads), its K and its V (grouped-query attention, as transformers' `repeat_kv`).

The reference is kvlab's own, behind the lab's interface (`KvlabKVCache`): K/V written
into a one-layer `KVPool` and read by `pooled_attention`, the torch attention every kvlab
kernel is checked against. The last check runs the real model, SmolLM2-135M (9 query
heads sharing 3 KV heads, 30 layers), through kvlab's `ModelRunner` with one learner's
cache per layer in place of the pool and its attention, a few tokens at once and then one
at a time, and compares every position's logits with the model's forward pass over the
whole text without a cache (transformers, `use_cache=False`).
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable

import torch

from kvlab.cache.pool import KVPool
from kvlab.cache.spec import KVSpec
from kvlab.labs.grading import SEED_STRIDE, Broken, Case, LabResult, grade, search, where
from kvlab.model.attention import pooled_attention
from kvlab.model.metadata import build_attention_metadata

SHAPES = (
    "k and v hold (tokens, num_kv_heads, head_dim); attend(q) returns (n, num_heads, "
    "head_dim) in q's dtype"
)
KEEPS = "append keeps every cached token: k and v are all the K and V appended, in order"
ATTENDS = "a query attends over every cached token: softmax(q k^T / sqrt(head_dim)) v"
CAUSAL = "within an append, query i sees the cached tokens and the new ones up to itself only"
LIKE_KVLAB = "any sequence of appends gives the outputs of kvlab's KV cache (pooled_attention)"
GQA = "query head h reads KV head h // (num_heads // num_kv_heads): its K and its V"
MODEL = (
    "SmolLM2-135M run through your cache, a few tokens and then one at a time, gives the "
    "logits of its forward pass without a cache"
)
ATOL, RTOL = 1e-5, 1e-4  # float32 attention over a few tokens: rounding only
MODEL_ATOL = 2e-3  # the model's logits (|logit| up to ~40) after 30 layers of float32
MODEL_TEXTS = (  # the real-model check's texts: the seed picks one (and the first append)
    "The KV cache keeps the keys and values of every token, so each new token",
    "Paris is the capital of France, and Berlin is the capital of",
    "A block allocator hands out fixed-size pages of memory to each request",
    "Attention compares the query of the newest token with the key of every earlier",
)


# --- inputs ---------------------------------------------------------------------------------
def kv_inputs(
    tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, draw: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random q (tokens, num_heads, head_dim), k and v (tokens, num_kv_heads, head_dim),
    float32: the same for the same arguments (`draw` picks another set)."""
    gen = torch.Generator().manual_seed(draw)
    q = torch.randn(tokens, num_heads, head_dim, generator=gen) * 1.5
    k = torch.randn(tokens, num_kv_heads, head_dim, generator=gen) * 1.5
    v = torch.randn(tokens, num_kv_heads, head_dim, generator=gen)
    return q, k, v


# --- kvlab's cache, behind the lab's interface ----------------------------------------------
class KvlabKVCache:
    """kvlab's KV cache of one layer behind the lab's interface: K/V written into a
    one-layer `KVPool` (slots 0 .. T - 1, one block of `capacity` slots), attention by
    `kvlab.model.attention.pooled_attention` with the block table [0]."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        capacity: int = 512,
    ):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.capacity, self.length = capacity, 0
        spec = KVSpec(1, num_kv_heads, head_dim)
        self.pool = KVPool(spec, capacity, dtype, torch.device("cpu"))

    @property
    def k(self) -> torch.Tensor:
        return self.pool.k[0, : self.length]

    @property
    def v(self) -> torch.Tensor:
        return self.pool.v[0, : self.length]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        n = k.shape[0]
        if self.length + n > self.capacity:
            raise ValueError(f"KvlabKVCache holds {self.capacity} tokens; pass a larger capacity")
        self.pool.write(0, torch.arange(self.length, self.length + n), k, v)
        self.length += n

    def attend(self, q: torch.Tensor) -> torch.Tensor:
        n = q.shape[0]
        meta = build_attention_metadata(
            [self.length - n], [n], [[0]], self.capacity, torch.device("cpu")
        )
        return pooled_attention(q, 0, self.pool, meta, self.head_dim**-0.5)


# --- plain attention, for the diagnoses -----------------------------------------------------
def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask: str = "causal",
    heads: str = "grouped",
) -> torch.Tensor:
    """softmax(q k^T * scale) v in float64. mask: "causal" (the new tokens are the last n),
    "none", "top-left" (as if they were the first n), "new only" (the append's own tokens);
    heads: "grouped" (h // group, right) or "tiled" (h % num_kv_heads)."""
    n, num_heads, _ = q.shape
    total, num_kv = k.shape[:2]
    group = num_heads // num_kv
    index = torch.arange(num_heads)
    index = index // group if heads == "grouped" else index % num_kv
    k, v = k.double()[:, index], v.double()[:, index]  # (T, heads, d)
    scores = torch.einsum("nhd,thd->hnt", q.double(), k) * scale
    rows, cols = torch.arange(n)[:, None], torch.arange(total)[None, :]
    visible = {
        "causal": cols <= rows + total - n,
        "none": torch.ones(n, total, dtype=torch.bool),
        "top-left": cols <= rows,
        "new only": (cols >= total - n) & (cols <= rows + total - n),
    }[mask]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hnt,thd->nhd", scores.softmax(-1), v)


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return (
        isinstance(got, torch.Tensor)
        and got.shape == want.shape
        and bool(torch.isfinite(got).all())
        and torch.allclose(got.double(), want.double(), atol=ATOL, rtol=RTOL)
    )


def _diagnose(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    """A hint naming the mistake `out` matches, if it matches a known one."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    n, total, num_kv = q.shape[0], k.shape[0], k.shape[1]
    right = head_dim**-0.5
    for scale, name in (
        (1.0, "no scale at all"),
        (1 / head_dim, "1 / head_dim"),
        ((num_heads * head_dim) ** -0.5, "1 / sqrt(num_heads * head_dim)"),
        (head_dim**0.5, "sqrt(head_dim)"),
    ):
        if _close(out, _attention(q, k, v, scale)):
            return (
                f"your outputs match a scale of {name} ({scale:.4g}); the scores are "
                f"q k^T / sqrt(head_dim): head_dim ** -0.5 = {right:.4g} here"
            )
    if n > 1 and _close(out, _attention(q, k, v, right, mask="none")):
        return (
            "each query also saw the tokens appended after it in the same append: before "
            "the softmax, set the scores of positions after the query's own to -inf"
        )
    if n < total and _close(out, _attention(q, k, v, right, mask="top-left")):
        return (
            f"your mask lets query i see positions 0 .. i, as if the {n} new tokens were the "
            f"first of the sequence, but they are the last {n} of {total}: query i sees "
            f"0 .. {total - n} + i. torch's is_causal=True (and a plain tril of an n x T "
            "matrix) aligns the mask top-left; shift it by T - n (tril(diagonal=T - n))"
        )
    if n < total and _close(out, _attention(q, k, v, right, mask="new only")):
        return (
            "the queries attended only over this append's own tokens: attend over every "
            "cached token (self.k, self.v), not only the k and v just appended"
        )
    if num_kv < num_heads and _close(out, _attention(q, k, v, right, heads="tiled")):
        group = num_heads // num_kv
        return (
            f"query head h read KV head h % {num_kv} (the KV heads tiled, as .repeat does); "
            f"the {group} query heads of a group are consecutive: head h reads KV head "
            f"h // {group} (repeat_interleave({group}, dim=1), as transformers' repeat_kv)"
        )
    return ""


def _row_report(out: torch.Tensor, want: torch.Tensor, total: int) -> tuple[str, str, str]:
    """(where, got, expected) for the first query row and head that differ."""
    n = want.shape[0]
    for i in range(n):
        for h in range(want.shape[1]):
            if not _close(out[i, h], want[i, h]):
                where_ = f"out[{i}, {h}] (query {i}, at position {total - n + i}, head {h})"
                got = f"{where_} = {_values(out[i, h])}"
                expected = f"{_values(want[i, h])}: attention over positions 0 .. {total - n + i}"
                return where_, got, expected
    return "", "", ""


def _values(x: torch.Tensor) -> str:
    values = [f"{float(t):.4f}" for t in x.flatten()[:4]]
    more = ", ..." if x.numel() > 4 else ""
    return "[" + ", ".join(values) + more + "]"


# --- the checks -----------------------------------------------------------------------------
class _Run:
    """One cache under test, its calls logged as code the learner can paste and run."""

    def __init__(self, cls, heads: int, kv_heads: int, head_dim: int, tokens: int, draw: int):
        self.cls = cls
        self.sizes = (heads, kv_heads, head_dim)
        self.q, self.k, self.v = kv_inputs(tokens, heads, kv_heads, head_dim, draw)
        self.lines = [
            f"cache = {cls.__name__}(num_heads={heads}, num_kv_heads={kv_heads}, "
            f"head_dim={head_dim})",
            f"q, k, v = kv_inputs({tokens}, num_heads={heads}, num_kv_heads={kv_heads}, "
            f"head_dim={head_dim}, draw={draw})",
        ]
        self.learner = cls(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim)
        self.total = 0

    def text(self) -> str:
        return "\n".join(self.lines)

    def broken(self, invariant: str, got: str, expected: str, hint: str = "") -> Broken:
        return Broken(invariant, got, expected, hint, self.text())

    def append(self, n: int) -> None:
        a, b = self.total, self.total + n
        self.lines.append(f"cache.append(k[{a}:{b}], v[{a}:{b}])")
        self.learner.append(self.k[a:b].clone(), self.v[a:b].clone())
        self.total = b
        for name in ("k", "v"):
            stored, want = getattr(self.learner, name, None), getattr(self, name)[:b]
            if not isinstance(stored, torch.Tensor):
                raise self.broken(
                    KEEPS,
                    f"cache.{name} is {type(stored).__name__}",
                    f"a tensor: {name}[:{b}], shape {tuple(want.shape)}",
                )
            if stored.shape == want.shape and torch.equal(stored.to(want.dtype), want):
                continue
            self.lines.append(f"cache.{name}.shape{' ' * 18}# -> {tuple(stored.shape)}")
            hint = ""
            if stored.shape[1:] == want.shape[1:] and stored.shape[0] == n < b:
                if torch.equal(stored.to(want.dtype), want[a:b]):
                    hint = (
                        f"cache.{name} holds only the {n} token(s) just appended: "
                        f"`self.{name} = {name}` replaces the cache; torch.cat((self.{name}, "
                        f"{name})) appends to it"
                    )
            elif stored.shape[1:] == want.shape[1:] and stored.shape[0] > b:
                hint = (
                    f"cache.{name} holds more tokens than were appended: does each cache "
                    "hold its own tensors (no class attributes shared by instances)?"
                )
            elif stored.shape[1:] == want.shape[1:] and stored.shape[0] == b:
                hint = "the tokens are all there but out of order: append the new ones last"
            elif stored.dim() == 3 and stored.shape[0] == want.shape[0]:
                hint = "concatenate along the token dimension, dim=0"
            raise self.broken(
                KEEPS,
                f"after appending {b} token(s), cache.{name} has shape {tuple(stored.shape)}"
                + ("" if stored.shape != want.shape else " but other values"),
                f"{name}[:{b}], shape {tuple(want.shape)}",
                hint,
            )

    def attend(self, invariant: str) -> None:
        """attend(q) for the tokens just appended, against kvlab's cache."""
        n = self._last
        a, b = self.total - n, self.total
        self.lines.append(f"out = cache.attend(q[{a}:{b}])")
        q = self.q[a:b]
        try:
            out = self.learner.attend(q.clone())
        except Exception as error:
            if invariant != GQA:
                raise
            raise self.broken(
                GQA,
                f"attend raised {type(error).__name__}: {error}{where(error)}",
                f"(n, num_heads, head_dim) = {(n, self.sizes[0], self.sizes[2])}",
                f"{self.sizes[0]} query heads share {self.sizes[1]} KV heads: repeat each KV "
                f"head for its {self.sizes[0] // self.sizes[1]} query heads, K and V alike "
                f"(repeat_interleave({self.sizes[0] // self.sizes[1]}, dim=1)), before the "
                "scores and before the weighted sum",
            ) from None
        reference = KvlabKVCache(*self.sizes)
        reference.append(self.k[:b], self.v[:b])
        want = reference.attend(q)
        if not isinstance(out, torch.Tensor) or out.shape != want.shape:
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise self.broken(SHAPES, f"attend returned {shape}", f"{tuple(want.shape)}")
        if _close(out, want):
            return
        _, got, expected = _row_report(out, want, b)
        hint = _diagnose(out, q, self.k[:b], self.v[:b])
        raise self.broken(invariant, got, expected, hint)

    def step(self, n: int, invariant: str) -> None:
        self._last = n
        self.append(n)
        self.attend(invariant)


def _check_shapes(cls) -> None:
    run = _Run(cls, 2, 2, 4, 3, 0)
    for name in ("k", "v"):
        stored = getattr(run.learner, name, None)
        if not isinstance(stored, torch.Tensor) or tuple(stored.shape) != (0, 2, 4):
            shape = tuple(stored.shape) if isinstance(stored, torch.Tensor) else stored
            raise run.broken(
                SHAPES,
                f"a new cache's {name} is {shape}",
                "an empty tensor of shape (0, 2, 4): no token cached yet",
                "keep the __init__ given: torch.empty(0, num_kv_heads, head_dim, dtype=dtype)",
            )
    run.lines.append("cache.append(k, v)")
    run.learner.append(run.k.clone(), run.v.clone())
    for name in ("k", "v"):
        stored = getattr(run.learner, name)
        if not isinstance(stored, torch.Tensor) or tuple(stored.shape) != (3, 2, 4):
            shape = tuple(stored.shape) if isinstance(stored, torch.Tensor) else stored
            raise run.broken(SHAPES, f"cache.{name} is {shape}", "shape (3, 2, 4): 3 tokens cached")
        if stored.dtype != torch.float32:
            raise run.broken(SHAPES, f"cache.{name}.dtype is {stored.dtype}", "torch.float32")
    run.lines.append("out = cache.attend(q)")
    out = run.learner.attend(run.q.clone())
    if not isinstance(out, torch.Tensor):
        raise run.broken(SHAPES, f"attend returned a {type(out).__name__}", "a torch.Tensor")
    if tuple(out.shape) != (3, 2, 4) or out.dtype != torch.float32:
        raise run.broken(
            SHAPES,
            f"out has shape {tuple(out.shape)} and dtype {out.dtype}",
            "shape (3, 2, 4) (n, num_heads, head_dim), dtype torch.float32 (q's)",
            "the output has one row per query and one head per query head; the weighted sum "
            "is over the cached tokens (the softmax's last dimension)",
        )


def _check_one_at_a_time(cls, seed: int) -> None:
    run = _Run(cls, 2, 2, 4, 5, SEED_STRIDE * seed + 1)
    for _ in range(5):
        run.step(1, ATTENDS)


def _check_causal(cls, seed: int) -> None:
    for first, then in ((4, 3), (1, 4)):
        run = _Run(cls, 2, 2, 4, first + then, SEED_STRIDE * seed + 2 + first)
        run.step(first, CAUSAL)
        run.step(then, CAUSAL)


def _check_several(cls, seed: int) -> None:
    rng = random.Random(SEED_STRIDE * seed + 3)
    cases = []
    for _ in range(6):
        draw, appends = rng.randrange(1_000_000), rng.randint(2, 6)
        cases.append(Case((draw,), tuple(rng.randint(1, 5) for _ in range(appends))))

    def run_case(case: Case) -> None:
        run = _Run(cls, 2, 2, 8, sum(case.ops), case.params[0])
        for n in case.ops:
            run.step(n, LIKE_KVLAB)

    search(cases, run_case)


def _check_gqa(cls, seed: int) -> None:
    for heads, kv_heads in ((9, 3), (4, 2), (4, 1)):
        run = _Run(cls, heads, kv_heads, 4, 3, SEED_STRIDE * seed + 4 + heads + kv_heads)
        for _ in range(3):
            run.step(1, GQA)


# --- the real model -------------------------------------------------------------------------
@functools.cache
def _model():
    """SmolLM2-135M-Instruct on the CPU in float32 (kvlab.load_model: embedded, offline)."""
    from kvlab.model.loading import load_model

    return load_model(device="cpu", dtype=torch.float32, progress=False)


@functools.cache
def _no_cache_logits(text: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The text's token ids and the model's logits at every position, over the whole text
    at once without a cache (transformers' forward, use_cache=False)."""
    model = _model()
    ids = model.tokenizer(text, return_tensors="pt").input_ids[0]
    with torch.inference_mode():
        logits = model.hf_model(ids[None], use_cache=False).logits[0].float()
    return ids, logits


class _LayerCaches:
    """Stands in for the runner's KVPool: layer i's K/V go into caches[i]."""

    def __init__(self, caches: list):
        self.caches = caches

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.caches[layer].append(k, v)


def _cache_attention(q, layer: int, pool: _LayerCaches, meta, scale: float) -> torch.Tensor:
    return pool.caches[layer].attend(q)


def run_model_with_cache(cls, ids: torch.Tensor, appends: list[int]) -> torch.Tensor:
    """The model's logits at every position of `ids`, computed by kvlab's ModelRunner with
    one `cls` cache per layer standing in for the pool and the attention; the tokens go in
    `appends` at a time (e.g. [5, 1, 1, ...]: 5 at once, then one at a time)."""
    from kvlab.model.runner import ModelRunner, kv_spec_of

    model = _model()
    cfg = model.config
    spec = kv_spec_of(cfg)
    runner = ModelRunner(model.hf_model, attention_fn=_cache_attention)
    outputs, start = [], 0
    with torch.inference_mode():
        caches = [
            cls(
                num_heads=cfg.num_attention_heads,
                num_kv_heads=spec.num_kv_heads,
                head_dim=spec.head_dim,
                dtype=model.dtype,
            )
            for _ in range(spec.num_layers)
        ]
        pool = _LayerCaches(caches)
        for n in appends:
            meta = build_attention_metadata([start], [n], [[0]], len(ids), torch.device("cpu"))
            step = ids[start : start + n]
            outputs.append(runner.forward(step, meta, pool, all_logits=True))  # type: ignore[arg-type]
            start += n
    return torch.cat(outputs)


def generate_with_cache(cls, prompt: str, max_new_tokens: int = 12) -> str:
    """Greedy decoding of SmolLM2-135M with one `cls` cache per layer: the prompt appended
    at once, then each new token alone. Returns the text generated."""
    from kvlab.model.runner import ModelRunner, kv_spec_of

    model = _model()
    cfg, tokenizer = model.config, model.tokenizer
    spec = kv_spec_of(cfg)
    runner = ModelRunner(model.hf_model, attention_fn=_cache_attention)
    ids = tokenizer(prompt, return_tensors="pt").input_ids[0]
    new: list[int] = []
    with torch.inference_mode():
        caches = [
            cls(
                num_heads=cfg.num_attention_heads,
                num_kv_heads=spec.num_kv_heads,
                head_dim=spec.head_dim,
                dtype=model.dtype,
            )
            for _ in range(spec.num_layers)
        ]
        pool, step, start = _LayerCaches(caches), ids, 0
        for _ in range(max_new_tokens):
            size = len(ids) + max_new_tokens
            meta = build_attention_metadata([start], [len(step)], [[0]], size, torch.device("cpu"))
            logits = runner.forward(step, meta, pool)  # type: ignore[arg-type]
            start += len(step)
            token = int(logits[-1].argmax())
            new.append(token)
            step = torch.tensor([token])
    return tokenizer.decode(new)


def generate_without_cache(prompt: str, max_new_tokens: int = 12) -> str:
    """Greedy decoding of SmolLM2-135M with no cache at all: every step runs the model
    over the whole text so far (transformers' forward, use_cache=False)."""
    model = _model()
    ids = model.tokenizer(prompt, return_tensors="pt").input_ids[0]
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            logits = model.hf_model(ids[None], use_cache=False).logits[0, -1]
            ids = torch.cat((ids, logits.argmax().reshape(1)))
    return model.tokenizer.decode(ids[-max_new_tokens:])


def _check_model(cls, seed: int) -> None:
    text = MODEL_TEXTS[seed % len(MODEL_TEXTS)]
    ids, want = _no_cache_logits(text)
    first = 3 + seed % 4  # tokens in the first append (the prompt), then one at a time
    appends = [first] + [1] * (len(ids) - first)
    example = (
        f"text = {text!r}  # {len(ids)} tokens\n"
        f"# SmolLM2-135M, one {cls.__name__} per layer (30): the first {first} tokens "
        "appended at once, then one at a time"
    )
    got = run_model_with_cache(cls, ids, appends)
    tokenizer = _model().tokenizer
    diff = (got - want).abs().amax(dim=-1)  # (T,) the largest difference at each position
    bad = torch.nonzero(~(diff <= MODEL_ATOL))
    if len(bad) == 0:
        return
    p = int(bad[0])
    theirs, right = int(got[p].argmax()), int(want[p].argmax())
    hint = (
        "the checks on small tensors pass but the model's 30 caches do not: does each "
        "instance keep its own K and V (no class attributes shared by instances), and does "
        "attend work with q of any shape and memory layout (use q's own dtype and shape)?"
    )
    raise Broken(
        MODEL,
        f"at position {p} (token {tokenizer.decode(ids[p : p + 1])!r}) the logits differ by up "
        f"to {float(diff[p]):.4g}; the next token would be {tokenizer.decode([theirs])!r}",
        f"within {MODEL_ATOL} of the forward without a cache, whose next token is "
        f"{tokenizer.decode([right])!r}",
        hint,
        example,
    )


def check_kv_cache(
    cls: Callable, verbose: bool = True, raise_on_failure: bool = False, seed: int = 0
) -> LabResult:
    """Grade a KV cache class: `cls(num_heads=, num_kv_heads=, head_dim=, dtype=)` with
    `k`, `v`, `append(k, v)` and `attend(q)` (this module's docstring says what each does).

    `seed` (default 0, the cases the notebook shows) draws other random cases for the same
    checks, and another text for the model: the lab source's hidden tests grade with a
    seed the learner has not seen.
    """
    checks = [
        ("shapes and dtypes", lambda: _check_shapes(cls)),
        ("appends one token at a time", lambda: _check_one_at_a_time(cls, seed)),
        ("causal mask within an append", lambda: _check_causal(cls, seed)),
        ("appends several tokens at once", lambda: _check_several(cls, seed)),
        ("GQA: query heads share KV heads", lambda: _check_gqa(cls, seed)),
        ("SmolLM2's logits through your cache", lambda: _check_model(cls, seed)),
    ]
    return grade("KV cache", checks, verbose, raise_on_failure)
