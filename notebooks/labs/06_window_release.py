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
# # Lab 6 · Releasing the blocks a sliding window leaves behind
#
# Notebook 11 draws a block table as a window slides over a long text: after every step,
# the blocks that fell out of the window turn orange and go back to the free list, and the
# table keeps its length (a released entry becomes `DROPPED`, -1, so position `p` still
# lives in logical block `p // block_size`). With **attention sinks** (StreamingLLM) the
# first tokens stay for good as well.
#
# The paged cache releases memory in whole blocks, so the rule after each step is:
#
# * the **window** is the last `window` tokens, positions `num_computed - window ..
#   num_computed - 1`: a block holding any of them stays, even if only its last slot is
#   in the window;
# * the **sinks** are the first `sinks` tokens, kept in whole blocks: the block holding the
#   last sink token stays, even if the rest of it is ordinary text;
# * the block holding the newest token always stays (the next token is written there);
# * every other whole block, entirely outside both, is released **now**, and only once: an
#   entry already `DROPPED` went back in an earlier step.
#
# Between `window` and `window + block_size - 1` recent tokens stay. kvlab's rule is the
# retention policies "window" and "sinks" (kvlab/cache/retention/window.py, sinks.py),
# whose `drop(table, num_computed)` the paged cache calls after every step.
#
# Your task: `release_blocks(...)`. The grader checks crafted cases at the window's edge
# and with sinks, a sequence growing step by step, then 150 random growths against
# kvlab's own rule, `kvlab_release`.

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
from kvlab.cache.retention import DROPPED  # -1: a table entry released in an earlier step
from kvlab.labs import check_window_release, kvlab_release
from kvlab.units import ceil_div  # noqa: F401 (ceil_div(n, d): the smallest integer >= n / d)

# %% [markdown]
# ## The exercise
#
# * `table`: the sequence's block table, one entry per block of `block_size` positions
#   (`DROPPED` where a block was released before);
# * `num_computed`: tokens whose K/V are in the cache (positions `0 .. num_computed - 1`);
# * `window`: recent tokens to keep (at least 1); `sinks`: first tokens to keep (0: none).
#
# Return the **logical indices** `i` of the table entries to release now. Change nothing
# in place: the cache marks them `DROPPED` and gives their blocks back.


# %% nbgrader={"grade": false, "grade_id": "exercise", "locked": false, "schema_version": 3, "solution": true, "task": false}
# EXERCISE: fill in every TODO, then run this cell.
def release_blocks(
    table: list[int], num_computed: int, block_size: int, window: int, sinks: int
) -> list[int]:
    """The logical blocks of `table` to release after this step."""
    # TODO: the first block that is not a sink block, the first block holding a window
    # token, and the entries between them that are not released yet
    raise NotImplementedError


# %% [markdown]
# ## Try it
#
# Block size 4, a window of 6 tokens and 2 sink tokens; 19 tokens computed, and logical
# block 1 was released in an earlier step.

# %% tags=["raises-exception"]
table = [4, DROPPED, 6, 7, 8]
print("you release:  ", release_blocks(table, 19, 4, 6, 2))
print("kvlab releases:", kvlab_release(table, 19, 4, 6, 2))

# %% [markdown]
# ## Grade it
#
# The grader prints one line when every check passes; otherwise the first broken
# rule, the smallest input that breaks it, and what was expected.

# %% nbgrader={"grade": false, "grade_id": "grader", "locked": true, "schema_version": 3, "solution": false, "task": false}
result = check_window_release(release_blocks)

# %% [markdown]
# ## The checks, one cell each
#
# Each cell below passes if the grader's check of that name passed; if not, it raises
# `LabFailure` with that check's report (the broken invariant, the smallest failing input,
# what was expected). Under nbgrader each of these cells is autograded and worth the points
# it names, so a partly right answer gets partial marks; the cells are locked. When your lab
# is graded, each cell also runs its check on random cases this notebook does not show
# (hidden tests): code that passes only the cases shown here loses those points.

# %% nbgrader={"grade": true, "grade_id": "check_whole_blocks_outside_the_window", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 2 points: the check "whole blocks outside the window".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("whole blocks outside the window")

# %% nbgrader={"grade": true, "grade_id": "check_sink_blocks_stay", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 2 points: the check "sink blocks stay".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("sink blocks stay")

# %% nbgrader={"grade": true, "grade_id": "check_the_window_s_edge", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 2 points: the check "the window's edge".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("the window's edge")

# %% nbgrader={"grade": true, "grade_id": "check_a_growing_sequence_step_by_step", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 2 points: the check "a growing sequence, step by step".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("a growing sequence, step by step")

# %% nbgrader={"grade": true, "grade_id": "check_random_growth_vs_kvlab_s_retention", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 2 points: the check "random growth vs kvlab's retention".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("random growth vs kvlab's retention")

# %% [markdown]
# ## What the grader checks
#
# That the function returns distinct logical indices of the table and leaves it alone;
# whole blocks outside a window without sinks; sinks (also a sink count that ends inside a
# block); the window's edge (its first token at, just before and just after a block
# boundary); a sequence growing one step at a time, where released entries are `DROPPED`
# and their blocks are handed out again; and 150 random growths against `kvlab_release`.
#
# ## What to try next
#
# * How many blocks does a sequence hold at most with window `W`, `S` sinks and block
#   size `B`? Compare with `kept_blocks()` of kvlab's policies.
# * Notebook 11 shows perplexity and needle recall against KV kept. Run it with
#   `retention="window"` and with `"sinks"` at the same memory: where do they differ?
# * kvlab indexes only the leading run of kept blocks for prefix sharing (`leading_kept`
#   in kvlab/cache/retention/base.py). Why can a later request not reuse the blocks after a
#   released one, though they are still in memory?
