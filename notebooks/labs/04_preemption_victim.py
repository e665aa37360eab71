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
# # Lab 4 · Choosing whom to preempt
#
# An engine that admits requests optimistically (once their *prompt* fits, not their
# longest possible answer) can run out of KV blocks halfway through a decode step. Then it
# **preempts** a running request: takes its blocks back, and later recomputes its K/V (or
# swaps them back in from host memory). Which request should go?
#
# kvlab's rule, `choose_victim` in `kvlab/engine/scheduler.py` (the scheduler calls it when a
# step needs a block and none is left):
#
# 1. the **lowest priority** first: in kvlab a larger `priority` is more important (vLLM's
#    convention is the reverse: a smaller value goes first);
# 2. among equal priorities, the **most recently admitted** (the largest `admit_order`): it
#    has computed the least, so preempting it wastes the least work, and the requests that
#    were admitted first keep making progress instead of being preempted again and again.
#
# `admit_order` counts admissions: a preempted request gets a new, larger one when it is
# admitted again. Its `arrival_s` (when the request first arrived) never changes.
#
# Your task: `choose_victim(running)`. The grader checks crafted cases and then 300 random
# running sets against kvlab's own `choose_victim`, the function its `Scheduler` calls.

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
from kvlab.labs import check_victim_choice, kvlab_victim, running_seq
from kvlab.sequence import Sequence

# %% [markdown]
# ## The exercise
#
# Each element of `running` is a kvlab `Sequence` with `request_id`, `priority`,
# `admit_order`, `arrival_s` and `num_computed` (tokens whose K/V are cached). Return the
# victim itself; the scheduler removes it from `running`.


# %% nbgrader={"grade": false, "grade_id": "exercise", "locked": false, "schema_version": 3, "solution": true, "task": false}
# EXERCISE: fill in every TODO, then run this cell.
def choose_victim(running: list[Sequence]) -> Sequence:
    """The running sequence to preempt: lowest priority, then the most recently admitted."""
    # TODO: return one of the sequences in `running` (leave the list as it is)
    raise NotImplementedError


# %% [markdown]
# ## Try it

# %% tags=["raises-exception"]
running = [
    running_seq(0, priority=0, admit_order=1, arrival_s=0.0),
    running_seq(1, priority=1, admit_order=2, arrival_s=0.1),  # an important request
    running_seq(2, priority=0, admit_order=4, arrival_s=0.2),  # preempted once, back again
    running_seq(3, priority=0, admit_order=3, arrival_s=0.3),
]
print("you preempt request", choose_victim(running).request_id)
print("kvlab's scheduler preempts request", kvlab_victim(running).request_id)

# %% [markdown]
# ## Grade it
#
# The grader prints one line when every check passes; otherwise the first broken
# rule, the smallest input that breaks it, and what was expected.

# %% nbgrader={"grade": false, "grade_id": "grader", "locked": true, "schema_version": 3, "solution": false, "task": false}
result = check_victim_choice(choose_victim)

# %% [markdown]
# ## The checks, one cell each
#
# Each cell below passes if the grader's check of that name passed; if not, it raises
# `LabFailure` with that check's report (the broken invariant, the smallest failing input,
# what was expected). Under nbgrader each of these cells is autograded and worth the points
# it names, so a partly right answer gets partial marks; the cells are locked. When your lab
# is graded, each cell also runs its check on random cases this notebook does not show
# (hidden tests): code that passes only the cases shown here loses those points.

# %% nbgrader={"grade": true, "grade_id": "check_returns_a_running_sequence", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 2 points: the check "returns a running sequence".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("returns a running sequence")

# %% nbgrader={"grade": true, "grade_id": "check_priorities", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 2 points: the check "priorities".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("priorities")

# %% nbgrader={"grade": true, "grade_id": "check_most_recently_admitted_first", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 3 points: the check "most recently admitted first".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("most recently admitted first")

# %% nbgrader={"grade": true, "grade_id": "check_independent_of_list_order", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 1 point: the check "independent of list order".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("independent of list order")

# %% nbgrader={"grade": true, "grade_id": "check_random_running_sets_vs_kvlab_s_scheduler", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 2 points: the check "random running sets vs kvlab's Scheduler".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("random running sets vs kvlab's Scheduler")

# %% [markdown]
# ## What the grader checks
#
# That the victim is one of the running sequences and the list is left alone; the priority
# rule; the most-recently-admitted rule (including a request that arrived first but was
# re-admitted last); that the choice does not depend on the list's order; and 300 random
# running sets against kvlab's `choose_victim`, which its `Scheduler` calls.
#
# ## What to try next
#
# * vLLM's v1 scheduler, without priorities, preempts the request at the end of its running
#   list (the one scheduled last); with priority scheduling it takes the largest priority
#   value, then the latest arrival. Where does using `arrival_s` instead of `admit_order`
#   choose differently?
# * Preempting the request with the fewest cached tokens also "wastes the least work". Why
#   can that starve a long request? Try it in the grader.
# * Watch preemption happen: an engine with `admission="watermark"` and a small
#   `kv_budget_tokens` (see `tests/test_scheduler.py`) records every preemption in
#   `engine.stats()`.
