"""Lab 8 grader: reading a vLLM /metrics page (Prometheus text) and two diagnoses from it.

The learner writes

    parse_metrics(text) -> list[(name, labels, value)]   one per sample line, page order
    hit_rate(before, after) -> (rate or None, verdict)   the prefix cache over the interval
    preemptions(before, after) -> (count, usage)         preemptions in it, KV usage after

from two scraped pages. The hit rate is the interval's delta of `vllm:prefix_cache_hits`
over the delta of `vllm:prefix_cache_queries` (tokens, not requests); the verdict says
"hits", or why the rate is 0 ("prefix caching off", read from `vllm:cache_config_info`'s
label `enable_prefix_caching`, else "no shared prefixes"), or "no queries" (rate None) when
the interval had none. Preemptions are the delta of the counter `vllm:num_preemptions`
(not the per-request histogram, which sees only finished requests); usage is the after
page's `vllm:kv_cache_usage_perc`, a fraction.

The pages are rendered by kvlab's own server metrics with vLLM's names
(kvlab.labs.metrics_pages), the same for every run. The reference parser is
prometheus_client's (`kvlab_parse`).
"""

from __future__ import annotations

import functools
import math
import random
import re

from kvlab.labs.grading import SEED_STRIDE, LabResult, Transcript, grade
from kvlab.labs.metrics_pages import (
    HIT_SCENARIOS,
    MODEL,
    PREEMPTION_SCENARIOS,
    Scenario,
    label_page,
    pages,
    random_scenarios,
    sample_page,
)

NO_QUERIES, CACHING_OFF, NO_SHARED, HITS = (
    "no queries",
    "prefix caching off",
    "no shared prefixes",
    "hits",
)
VERDICTS = (NO_QUERIES, CACHING_OFF, NO_SHARED, HITS)
QUERIES_TOTAL = "vllm:prefix_cache_queries_total"
HITS_TOTAL = "vllm:prefix_cache_hits_total"
PREEMPTIONS_TOTAL = "vllm:num_preemptions_total"
USAGE = "vllm:kv_cache_usage_perc"

PARSE_RETURNS = "parse_metrics returns a list of (name, labels, value): str, dict of str, float"
SAMPLES = "every sample line is one sample, in page order; comment and blank lines are none"
NAMES = "a sample keeps its name as written (_total, _created, _bucket, _sum, _count included)"
VALUES = "a sample's value is the number after its name and labels (a timestamp may follow)"
LABELS = "label values are read whole: quoted, with commas, spaces, braces and escapes"
LIKE_KVLAB = "the same samples as prometheus_client's parser reads"
RATE_RETURNS = "hit_rate returns (rate, verdict): a float in 0..1 or None, and a verdict"
DELTAS = "the hit rate is over the interval: hits after - before over queries after - before"
PER_QUERY = "the hit rate divides prefix-cache hits by prefix-cache queries (tokens), not requests"
EMPTY = 'an interval without prefix-cache queries has no hit rate: (None, "no queries")'
ZERO = 'a 0% hit rate says why: "prefix caching off" (cache_config_info), else "no shared prefixes"'
VERDICT = 'a hit rate above 0 has the verdict "hits"'
PRE_RETURNS = "preemptions returns (count, usage): an int and a float"
PREEMPTED = "preemptions in the interval: the counter vllm:num_preemptions_total, after - before"
KV_USAGE = "KV usage is the after page's vllm:kv_cache_usage_perc, a fraction (1 means 100%)"


# --- the reference -------------------------------------------------------------------------
def kvlab_parse(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample of a Prometheus text page, as prometheus_client's parser reads it."""
    return [(name, dict(labels), value) for name, labels, value in _parsed(text)]


@functools.lru_cache(maxsize=512)
def _parsed(text: str) -> tuple[tuple[str, tuple[tuple[str, str], ...], float], ...]:
    # prometheus_client's parser reads a character at a time (~30 ms a page); a grader
    # reads the same pages for every answer it judges.
    from prometheus_client.parser import text_string_to_metric_families

    return tuple(
        (s.name, tuple(s.labels.items()), float(s.value))
        for family in text_string_to_metric_families(text)
        for s in family.samples
    )


def _total(samples, name: str) -> float:
    return sum(value for n, _, value in samples if n == name)


def kvlab_hit_rate(before: str, after: str) -> tuple[float | None, str]:
    """The prefix cache over the interval between two pages: (rate, verdict)."""
    old, new = kvlab_parse(before), kvlab_parse(after)
    queries = _total(new, QUERIES_TOTAL) - _total(old, QUERIES_TOTAL)
    hits = _total(new, HITS_TOTAL) - _total(old, HITS_TOTAL)
    if queries == 0:
        return None, NO_QUERIES
    if hits == 0:
        info = [labels for n, labels, _ in new if n == "vllm:cache_config_info"]
        off = any(labels.get("enable_prefix_caching") == "False" for labels in info)
        return 0.0, CACHING_OFF if off else NO_SHARED
    return hits / queries, HITS


def kvlab_preemptions(before: str, after: str) -> tuple[int, float]:
    """(preemptions in the interval, KV cache usage on the after page)."""
    old, new = kvlab_parse(before), kvlab_parse(after)
    count = _total(new, PREEMPTIONS_TOTAL) - _total(old, PREEMPTIONS_TOTAL)
    usage = max((v for n, _, v in new if n == USAGE), default=0.0)
    return int(count), usage


# --- judging the learner's answers ---------------------------------------------------------
_SHOWN = (
    QUERIES_TOTAL,
    HITS_TOTAL,
    PREEMPTIONS_TOTAL,
    USAGE,
    "vllm:num_requests_running",
    "vllm:request_num_preemptions_sum",
    "vllm:request_num_preemptions_count",
)


def _excerpt(page: str) -> list[str]:
    lines = []
    for line in page.splitlines():
        name = re.split(r"[{ ]", line, maxsplit=1)[0]
        if name in _SHOWN or (name == "vllm:request_success_total" and "length" in line):
            lines.append(line.replace(f',model_name="{MODEL}"', ""))
        elif name == "vllm:cache_config_info":
            on = re.search(r'enable_prefix_caching="(\w+)"', line).group(1)
            lines.append(f'vllm:cache_config_info{{...,enable_prefix_caching="{on}",...}} 1.0')
    return lines


def _log(scenario: Scenario, before: str, after: str) -> Transcript:
    log = Transcript()
    log.add(f"# the interval: {scenario.what} (model_name labels left out)")
    log.add("# before, the lines that matter:")
    for line in _excerpt(before):
        log.add(line)
    log.add("# after:")
    for line in _excerpt(after):
        log.add(line)
    return log


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def _judge_rate(fn, scenario: Scenario) -> None:
    before, after = pages(scenario)
    want = kvlab_hit_rate(before, after)
    log = _log(scenario, before, after)
    old, new = kvlab_parse(before), kvlab_parse(after)
    queries = _total(new, QUERIES_TOTAL) - _total(old, QUERIES_TOTAL)
    hits = _total(new, HITS_TOTAL) - _total(old, HITS_TOTAL)
    requests = _total(new, "vllm:request_success_total") - _total(old, "vllm:request_success_total")
    expected = f"{want}"
    try:
        out = fn(before, after)
    except ZeroDivisionError:
        log.add(f"{fn.__name__}(before, after)", note="raises ZeroDivisionError")
        raise log.broken(
            EMPTY,
            "ZeroDivisionError: the interval had no prefix-cache queries",
            expected,
            "no queries, no rate: check for it before dividing",
        ) from None
    log.add(f"{fn.__name__}(before, after)", out)
    try:
        rate, verdict = out
    except (TypeError, ValueError):
        raise log.broken(RATE_RETURNS, f"returned {out!r}"[:200], expected) from None
    if rate is not None and not isinstance(rate, (int, float)) or verdict not in VERDICTS:
        raise log.broken(RATE_RETURNS, f"returned {out!r}"[:200], f"{expected}, one of {VERDICTS}")
    if queries == 0:
        if rate is not None or verdict != NO_QUERIES:
            raise log.broken(
                EMPTY,
                f"returned {out!r}",
                expected,
                "0 / 0 is no rate (not 0%, not NaN): nothing was looked up",
            )
        return
    if rate is None or not _close(rate, want[0]):
        if rate is not None and _close(rate, _total(new, HITS_TOTAL) / _total(new, QUERIES_TOTAL)):
            raise log.broken(
                DELTAS,
                f"rate {rate}: the totals since the server started",
                f"{want[0]}: {hits:g} hits / {queries:g} queries in the interval",
                "counters only grow: subtract the before page's value from the after page's",
            )
        if rate is not None and requests and _close(rate, hits / requests):
            raise log.broken(
                PER_QUERY,
                f"rate {rate}: {hits:g} hit tokens / {requests:g} requests",
                f"{want[0]}: {hits:g} hits / {queries:g} queries (prompt tokens looked up)",
                "vllm:prefix_cache_queries counts tokens, as the hits do",
            )
        raise log.broken(DELTAS, f"rate {rate!r}", f"{want[0]}: {hits:g} / {queries:g}")
    if verdict != want[1]:
        if want[0] == 0:
            raise log.broken(
                ZERO,
                f"verdict {verdict!r}",
                expected,
                'cache_config_info\'s label enable_prefix_caching="False" means it is off',
            )
        raise log.broken(VERDICT, f"verdict {verdict!r}", expected)


def _judge_preemptions(fn, scenario: Scenario) -> None:
    before, after = pages(scenario)
    want = kvlab_preemptions(before, after)
    log = _log(scenario, before, after)
    out = fn(before, after)
    log.add(f"{fn.__name__}(before, after)", out)
    try:
        count, usage = out
    except (TypeError, ValueError):
        raise log.broken(PRE_RETURNS, f"returned {out!r}"[:200], f"{want}") from None
    if not isinstance(count, (int, float)) or not isinstance(usage, (int, float)):
        raise log.broken(PRE_RETURNS, f"returned {out!r}"[:200], f"{want}")
    old, new = kvlab_parse(before), kvlab_parse(after)

    def delta(name: str) -> float:
        return _total(new, name) - _total(old, name)

    if count != want[0]:
        hint = ""
        if count == _total(new, PREEMPTIONS_TOTAL):
            hint = "that is the total since the server started: subtract the before page's"
        elif count == delta("vllm:request_num_preemptions_sum"):
            hint = (
                "the histogram vllm:request_num_preemptions observes each request when it "
                "finishes: its _sum misses the preemptions of requests still running"
            )
        elif count == delta("vllm:request_num_preemptions_count"):
            hint = "a histogram's _count is how many requests it observed, not preemptions"
        raise log.broken(PREEMPTED, f"count {count!r}", f"{want[0]}", hint)
    if not _close(usage, want[1]):
        hint = ""
        if _close(usage, want[1] * 100):
            hint = "vllm:kv_cache_usage_perc is already a fraction: 1 means 100 percent"
        elif _close(usage, max((v for n, _, v in old if n == USAGE), default=0.0)):
            hint = "that is the before page's: the usage now is the after page's"
        raise log.broken(KV_USAGE, f"usage {usage!r}", f"{want[1]!r}", hint)


def _labels_code(labels: dict) -> str:
    return "{" + ", ".join(f"{k!r}: {v!r}" for k, v in labels.items()) + "}"


def _judge_parse(fn, page: str, what: str) -> None:
    want = kvlab_parse(page)
    out = fn(page)
    log = Transcript()
    try:
        got = [tuple(s) for s in out]
    except TypeError:
        log.add(f"samples = {fn.__name__}(page)  # {what}", out)
        raise log.broken(PARSE_RETURNS, f"returned {out!r}"[:200], "a list") from None
    if any(len(s) != 3 for s in got):
        bad = next(s for s in got if len(s) != 3)
        raise log.broken(PARSE_RETURNS, f"a sample {bad!r}"[:200], "(name, labels, value)")
    lines = [ln for ln in page.splitlines() if ln.strip() and not ln.startswith("#")]
    for i, (g, w) in enumerate(zip(got, want)):
        name, labels, value = g
        log = Transcript()
        log.add(f"# {what}; sample line {i}:")
        log.add(lines[i] if i < len(lines) else "")
        log.add(f"{fn.__name__}(page)[{i}]", g)
        if not isinstance(name, str) or not isinstance(labels, dict):
            raise log.broken(PARSE_RETURNS, f"{g!r}"[:200], f"{w!r}")
        if name != w[0]:
            hint = ""
            if w[0].startswith(name):
                hint = "keep the whole name: vLLM's counters end in _total on the page"
            raise log.broken(NAMES, f"name {name!r}", f"{w[0]!r}", hint)
        if labels != w[1]:
            raise log.broken(
                LABELS,
                f"labels {_labels_code(labels)}"[:300],
                f"{_labels_code(w[1])}",
                'a quoted value may hold commas, spaces, braces and escaped quotes (\\"): '
                'read up to the closing unescaped "',
            )
        if not isinstance(value, (int, float)) or not _close(float(value), w[2]):
            hint = ""
            if isinstance(value, (int, float)) and len(lines[i].split()) > 2:
                hint = "after the value may come a timestamp (ms since 1970): it is not the value"
            raise log.broken(VALUES, f"value {value!r}", f"{w[2]!r}", hint)
    if len(got) != len(want):
        log = Transcript()
        log.add(f"samples = {fn.__name__}(page)  # {what}")
        extra = [s for s in got[len(want) :]][:1]
        hint = f"first extra: {extra[0]!r}"[:200] if extra else ""
        raise log.broken(
            SAMPLES, f"{len(got)} samples", f"{len(want)}: the page's sample lines", hint
        )


def _check_parse(fn, make, seed: int, base: int, what: str) -> None:
    rng = random.Random(base + SEED_STRIDE * seed)
    for i in range(6):
        _judge_parse(fn, make(rng), f"{what} {i}")


def _check_page(fn, seed: int) -> None:
    for scenario in [*HIT_SCENARIOS[:1], *random_scenarios(3, seed, 41)]:
        _judge_parse(fn, pages(scenario)[1], f"the after page of: {scenario.what}")


def _check_rates(fn, seed: int) -> None:
    for scenario in [*HIT_SCENARIOS, *random_scenarios(15, seed, 43)]:
        _judge_rate(fn, scenario)


def _check_preemptions(fn, seed: int) -> None:
    for scenario in [*PREEMPTION_SCENARIOS, *random_scenarios(15, seed, 47)]:
        _judge_preemptions(fn, scenario)


def check_metrics_reading(
    parse_metrics,
    hit_rate,
    preemptions,
    verbose: bool = True,
    raise_on_failure: bool = False,
    seed: int = 0,
) -> LabResult:
    """Grade `parse_metrics(text)`, `hit_rate(before, after)` and `preemptions(before,
    after)` (notebook 08 of the labs).

    `seed` (default 0, the cases the notebook shows) draws other random cases for the same
    checks: the lab sources' hidden tests grade with a seed the learner has not seen.
    """
    checks = [
        (
            "sample lines: names and values",
            lambda: _check_parse(parse_metrics, sample_page, seed, 31, "page"),
        ),
        (
            "labels: quoted, escaped, with commas",
            lambda: _check_parse(parse_metrics, label_page, seed, 37, "page"),
        ),
        ("a whole kvlab /metrics page", lambda: _check_page(parse_metrics, seed)),
        ("the prefix-cache hit rate over an interval", lambda: _check_rates(hit_rate, seed)),
        ("preemptions and KV usage", lambda: _check_preemptions(preemptions, seed)),
    ]
    return grade("Reading /metrics", checks, verbose, raise_on_failure)
