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
# # Lab 5 · Rolling back rejected drafts
#
# Notebook 09 animates speculative decoding in a block table: a decode step computes K/V
# for the pending token **and** k drafted tokens in one forward, so the table grows to hold
# all of them and `num_computed` counts the drafts. Verification then accepts the first
# `accepted` drafts; the K/V of the other `k - accepted` belong to tokens that will never be
# in the answer. The **rollback** (the orange blocks in 09's animation) forgets them:
#
# * `num_computed` goes back by the rejected drafts only: accepted drafts are real tokens
#   now, and their K/V stay;
# * the table keeps the blocks that hold a kept token, `ceil(num_computed / block_size)`
#   of them, and nothing else: the blocks after them held only rejected drafts;
# * each block leaving the table loses this table's reference. It goes back to the free
#   list only if no one else holds it (`ref_counts[block] == 1`); a block a fork shares
#   (ref count > 1) stays with the other table.
#
# kvlab's rollback is `Speculator.rollback` (kvlab/speculative/speculator.py), which calls
# `KVCache.rewind` and the paged cache's `_trim` (kvlab/cache/base.py, paged.py). kvlab
# never forks a sequence with drafts in flight (its `_trim` refuses a shared block past the
# kept tokens); a block manager that does (parallel sampling or beam search forked while
# drafting) must decref, not free, and your function handles that case too.
#
# Your task: `rollback(...)`. The grader checks crafted cases at block boundaries and with
# shared blocks, then 300 random rollbacks against kvlab's own, `kvlab_rollback`:
# `KVCache.rewind` on a real `PagedCache`, then `BlockAllocator.decref` of each leaving block.

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
from kvlab.labs import check_spec_rollback, kvlab_rollback
from kvlab.units import ceil_div  # noqa: F401 (ceil_div(n, d): the smallest integer >= n / d)

# %% [markdown]
# ## The exercise
#
# * `table`: the sequence's block table (physical block ids), holding positions
#   `0 .. num_computed - 1`: position `p` lives in block `table[p // block_size]`;
# * `num_computed`: tokens whose K/V were just computed, the `num_drafts` drafts included
#   (they are the last `num_drafts` positions);
# * `accepted`: how many of the drafts verification kept (the first ones);
# * `ref_counts[block]`: how many block tables hold `block` (1: only this one).
#
# Return `(num_computed, num_blocks, free_blocks)`: the rewound `num_computed`, how many
# blocks stay at the start of the table, and the blocks that go back to the free list.
# Change nothing in place: the cache trims the table and calls `decref` itself.


# %% nbgrader={"grade": false, "grade_id": "exercise", "locked": false, "schema_version": 3, "solution": true, "task": false}
# EXERCISE: fill in every TODO, then run this cell.
def rollback(
    table: list[int],
    block_size: int,
    num_computed: int,
    num_drafts: int,
    accepted: int,
    ref_counts: dict[int, int],
) -> tuple[int, int, list[int]]:
    """After verification: (num_computed, num_blocks, free_blocks)."""
    # TODO: the rewound num_computed (forget only the rejected drafts), the number of
    # blocks that still hold a kept token, and the leaving blocks no one else holds
    raise NotImplementedError


# %% [markdown]
# ## Try it
#
# Block size 4, a pending token at position 4 and 4 drafts at positions 5..8, one of them
# accepted; block 12 is shared with a fork.

# %% tags=["raises-exception"]
args = ([7, 3, 12], 4, 9, 4, 1, {7: 1, 3: 1, 12: 2})
print("your rollback:  ", rollback(*args))
print("kvlab's rollback:", tuple(kvlab_rollback(*args)))

# %% [markdown]
# ## Grade it
#
# The grader prints one line when every check passes; otherwise the first broken
# rule, the smallest input that breaks it, and what was expected.

# %% nbgrader={"grade": false, "grade_id": "grader", "locked": true, "schema_version": 3, "solution": false, "task": false}
result = check_spec_rollback(rollback)

# %% [markdown]
# ## The checks, one cell each
#
# Each cell below passes if the grader's check of that name passed; if not, it raises
# `LabFailure` with that check's report (the broken invariant, the smallest failing input,
# what was expected). Under nbgrader each of these cells is autograded and worth the points
# it names, so a partly right answer gets partial marks; the cells are locked. When your lab
# is graded, each cell also runs its check on random cases this notebook does not show
# (hidden tests): code that passes only the cases shown here loses those points.

# %% nbgrader={"grade": true, "grade_id": "check_all_drafts_accepted", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 2 points: the check "all drafts accepted".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("all drafts accepted")

# %% nbgrader={"grade": true, "grade_id": "check_rejected_drafts_inside_the_last_block", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 2 points: the check "rejected drafts inside the last block".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("rejected drafts inside the last block")

# %% nbgrader={"grade": true, "grade_id": "check_across_block_boundaries", "locked": true, "points": 3, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 3 points: the check "across block boundaries".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("across block boundaries")

# %% nbgrader={"grade": true, "grade_id": "check_shared_blocks_are_decref_d_not_freed", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 2 points: the check "shared blocks are decref'd, not freed".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("shared blocks are decref'd, not freed")

# %% nbgrader={"grade": true, "grade_id": "check_random_rollbacks_vs_kvlab_s_rewind", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 1 point: the check "random rollbacks vs kvlab's rewind".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("random rollbacks vs kvlab's rewind")

# %% [markdown]
# ## What the grader checks
#
# That the function returns two ints and a list of distinct table blocks and leaves its
# arguments alone; every draft accepted (nothing goes, even when the drafts end exactly at
# a block boundary); rejected drafts inside the last block (no block goes, `num_computed`
# still rewinds); rollbacks across one or more block boundaries (a block holding a kept
# token always stays, blocks after it always go); shared blocks, which only lose a
# reference; and 300 random rollbacks against `kvlab_rollback`.
#
# ## What to try next
#
# * In notebook 09, `speculator.stats.rolled_back_blocks` counts the blocks returned by
#   rollbacks. With 4-slot blocks and k = 4, at most how many blocks can one rollback
#   return? And with 16-slot blocks?
# * A rollback that returns blocks must also forget what they held: kvlab poisons freed
#   slots in debug mode (`EngineConfig(poison_freed=True)`), and a codec that groups tokens
#   (`KVPool.discard`) rolls back its state too. Why is a block holding only rejected drafts
#   never in the prefix index?
# * An engine could keep a rejected draft's block for the next step's drafts instead of
#   returning it at once. What does that save, and what does it cost under memory pressure?
