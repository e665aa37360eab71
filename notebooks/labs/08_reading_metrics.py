# ---
# jupyter:
#   jupytext:
#     cell_metadata_filter: nbgrader,tags,-all
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Lab 8 · Reading a vLLM /metrics page
#
# Do this lab after notebook 13, which runs `kvlab serve` and talks to it over HTTP.
# Notebook 07's dashboard reads the engine directly; a server in production is read
# through its `/metrics` page instead. kvlab serve exposes the series `vllm serve` exposes,
# with vLLM's names, labels and meanings (the section "/metrics: vLLM's names and
# meanings" of docs/design/serve.md; kvlab/serve/metrics.py). The page is Prometheus text:
#
# ```
# # HELP vllm:prefix_cache_hits Prefix cache hits, in terms of number of cached tokens.
# # TYPE vllm:prefix_cache_hits counter
# vllm:prefix_cache_hits_total{engine="0",model_name="SmolLM2-135M"} 1536.0
# vllm:prefix_cache_hits_created{engine="0",model_name="SmolLM2-135M"} 1.7961224402e+09
# ```
#
# * a line starting with `#` is a comment (HELP, TYPE), a blank line is nothing;
# * every other line is one **sample**: a name, optional labels in braces, a value, and
#   optionally a timestamp (milliseconds) after it;
# * a label value is in double quotes and may hold commas, spaces, braces, `=` and the
#   escapes `\"`, `\\` and `\n`;
# * a counter's sample is named `..._total` (and `..._created` is when it started); a
#   histogram's are `..._bucket{le="..."}`, `..._sum` (the sum of what it observed) and
#   `..._count` (how many observations).
#
# Counters only grow from the server's start, so what happened **between two scrapes** is
# the difference. Two diagnoses from the pages before and after a workload:
#
# * **the prefix-cache hit rate**: `vllm:prefix_cache_hits` over
#   `vllm:prefix_cache_queries`, both counted in prompt **tokens**, as deltas. With no
#   queries in the interval there is no rate: `(None, "no queries")`. A 0% rate says why:
#   `"prefix caching off"` when `vllm:cache_config_info` has the label
#   `enable_prefix_caching="False"`, else `"no shared prefixes"` (every prompt was new).
#   Otherwise the verdict is `"hits"`.
# * **preemptions**: the delta of the counter `vllm:num_preemptions` (the histogram
#   `vllm:request_num_preemptions` observes requests only when they finish), with the KV
#   usage on the after page, `vllm:kv_cache_usage_perc`: a fraction, 1 means 100%.
#
# Your task: `parse_metrics`, `hit_rate` and `preemptions`. The pages the grader uses are
# rendered by kvlab's own server metrics over small workloads on a real paged cache; the
# reference parser is prometheus_client's, `kvlab_parse`.

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
import re  # noqa: F401 (re.compile, re.match, re.sub: regular expressions)

from kvlab.labs import check_metrics_reading, example_pages, kvlab_hit_rate, kvlab_preemptions

# %% [markdown]
# ## The exercise
#
# `parse_metrics(text)` returns one `(name, labels, value)` per sample line, in page order:
# the name as written (with its `_total`), a dict of label values (unescaped), the value
# as a float. `hit_rate(before, after)` returns `(rate, verdict)`; `preemptions(before,
# after)` returns `(count, usage)`. A page may repeat a series under other labels (one per
# engine): add those samples up.


# %% nbgrader={"grade": false, "grade_id": "exercise", "locked": false, "schema_version": 3, "solution": true, "task": false}
# EXERCISE: fill in every TODO, then run this cell.
def parse_metrics(text: str) -> list:
    """Every sample of a Prometheus text page: (name, labels, value), in page order."""
    # TODO: skip comments and blank lines; read the name, the labels (quoted values may
    # hold commas, spaces, braces and escapes), then the value (a timestamp may follow)
    raise NotImplementedError


def hit_rate(before: str, after: str) -> tuple:
    """The prefix cache between two scrapes: (hit rate or None, verdict)."""
    # TODO: deltas of the hits and the queries; the four verdicts
    raise NotImplementedError


def preemptions(before: str, after: str) -> tuple:
    """(preemptions between two scrapes, KV cache usage on the after page)."""
    # TODO: the counter's delta; the usage gauge of the after page
    raise NotImplementedError


# %% [markdown]
# ## Try it
#
# Two scrapes of kvlab's page around four requests (two share a prompt's opening with
# earlier ones; one was preempted once and is still running).

# %% tags=["raises-exception"]
before, after = example_pages()
for name, labels, value in parse_metrics(after):
    if name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
        print(name, labels["engine"], value)
print("you:  ", hit_rate(before, after), preemptions(before, after))
print("kvlab:", kvlab_hit_rate(before, after), kvlab_preemptions(before, after))

# %% [markdown]
# ## Grade it
#
# The grader prints one line when every check passes; otherwise the first broken
# rule, the smallest input that breaks it, and what was expected.

# %% nbgrader={"grade": false, "grade_id": "grader", "locked": true, "schema_version": 3, "solution": false, "task": false}
result = check_metrics_reading(parse_metrics, hit_rate, preemptions)

# %% [markdown]
# ## The checks, one cell each
#
# Each cell below passes if the grader's check of that name passed; if not, it raises
# `LabFailure` with that check's report (the broken invariant, the smallest failing input,
# what was expected). Under nbgrader each of these cells is autograded and worth the points
# it names, so a partly right answer gets partial marks; the cells are locked. When your lab
# is graded, each cell also runs its check on random cases this notebook does not show
# (hidden tests): code that passes only the cases shown here loses those points.

# %% nbgrader={"grade": true, "grade_id": "check_sample_lines_names_and_values", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 2 points: the check "sample lines: names and values".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("sample lines: names and values")

# %% nbgrader={"grade": true, "grade_id": "check_labels_quoted_escaped_with_commas", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 2 points: the check "labels: quoted, escaped, with commas".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("labels: quoted, escaped, with commas")

# %% nbgrader={"grade": true, "grade_id": "check_a_whole_kvlab_metrics_page", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 2 points: the check "a whole kvlab /metrics page".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("a whole kvlab /metrics page")

# %% nbgrader={"grade": true, "grade_id": "check_the_prefix_cache_hit_rate_over_an_interval", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 2 points: the check "the prefix-cache hit rate over an interval".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("the prefix-cache hit rate over an interval")

# %% nbgrader={"grade": true, "grade_id": "check_preemptions_and_kv_usage", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 2 points: the check "preemptions and KV usage".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("preemptions and KV usage")

# %% [markdown]
# ## What the grader checks
#
# That `parse_metrics` reads every sample line (names with their suffixes, values,
# timestamps left out, comments skipped) and every label value whole (commas, spaces,
# braces, escapes, any label order), on small pages and on whole pages kvlab's server
# renders; that the hit rate is the interval's hits over its queries, with the four
# verdicts (an interval with no queries, caching off, nothing shared, hits); and that the
# preemptions are the counter's delta and the usage the after page's fraction.
#
# ## What to try next
#
# * The saved page of a real `vllm serve` 0.32 is tests/data/vllm_serve_metrics.txt: run
#   your parser on it. Which series does kvlab not have, and which does vLLM not have?
# * `vllm:kv_cache_usage_perc` leaves out cached blocks of finished requests (they can be
#   evicted). Which of kvlab's own series (`kvlab:kv_cache_cached_blocks`) explains a server
#   whose memory looks full at a low usage?
# * The mean time to first token over the interval is the delta of
#   `vllm:time_to_first_token_seconds_sum` over the delta of its `_count`. Add it.
