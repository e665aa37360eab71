# ---
# jupyter:
#   jupytext:
#     cell_metadata_filter: nbgrader,tags,-all
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.7
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Lab 11 · The cross-group prefix hit: what every layer kind can serve
#
# Notebook 16 runs a hybrid model, whose layers mix **full attention** with **sliding
# windows** (Gemma 3: five layers with a window to one full layer). kvlab's hybrid cache
# (`cache="hybrid"`, vLLM's hybrid KV cache manager) splits the layers into **KV cache
# groups** of one kind, and each group keeps its own block table and its own prefix index
# over one shared pool. A sliding group frees the blocks its window has left behind; they
# stay cached until the LRU evicts them, and the LRU evicts a block from one group's
# index, not from all of them. So when a prompt comes again, each group holds its own
# subset of the prompt's blocks, and a prefix hit is only as long as **every** group can
# serve: a layer that lacks its K/V for a cached token cannot compute the tokens after it.
#
# A hit of `h` blocks means that the prompt's first `h * block_size` tokens are not
# computed again; the first token computed is at position `p = h * block_size`.
#
# * A **full-attention** group serves it when it holds blocks `0 .. h - 1`: the token at
#   `p` reads every earlier token.
# * A **sliding** group with a window of `W` tokens serves it when it holds only the last
#   `need = ceil((W - 1) / block_size)` blocks of the hit, `max(0, h - need) .. h - 1`:
#   the token at `p` reads positions `p - W + 1 .. p`, and `p` itself is computed, so the
#   cache must give it the `W - 1` tokens before it. Blocks before those may be gone.
#
# The hit starts at `num_blocks`, the most it may take (the block of the prompt's last
# token always runs), and shrinks until every group serves it. The full groups bound it
# first: it ends at the first block one of them lacks. Then each sliding group moves it
# left to the longest hit **it** serves, found from the right: a run of `need` held
# blocks that ends at the hit, or a shorter run that reaches block 0. A window's hits have
# gaps (it may serve 7 blocks and not 4), so a move by one window can break another that
# agreed before: ask every window again, until none moves the hit. That is vLLM's
# `HybridKVCacheCoordinator.find_longest_cache_hit` ("an iterative fixed-point
# algorithm", vllm/v1/core/kv_cache_coordinator.py), with
# `SlidingWindowManager.find_longest_cache_hit` scanning each window from the right.
#
# **A worked example.** Block size 16; group 0 full, group 1 a window of 32 tokens
# (`need` = ceil(31 / 16) = 2), group 2 a window of 48 (`need` = 3); the hit may take 7
# blocks. Group 0 holds blocks 0-6, group 1 blocks {0, 1, 2, 5, 6}, group 2 {0, 1, 2, 3}.
#
# 1. Group 0 holds every block: the hit is 7.
# 2. Group 1 at 7 needs blocks 5, 6: held. Group 2 at 7 needs 4, 5, 6 and lacks 6, so
#    every hit that needs block 6 is out: 6 needs 3-5 (lacks 5), 5 needs 2-4 (lacks 4),
#    4 needs 1-3: held. The hit is 4.
# 3. Again: group 1 at 4 needs 2, 3 and lacks 3; at 3 it needs 1, 2: held. The hit is 3.
#    Group 2 at 3 needs 0-2: held.
# 4. Again: nobody moves it. The hit is 3 blocks, 48 tokens.
#
# Your task: `cross_group_hit(...)`. The grader checks crafted cases (full attention only,
# windows only, a window that forces the hit left, two windows that move each other, no
# hit), 300 random ones against kvlab's own rule (`kvlab.cache.groups.cross_group_hit`,
# which the hybrid cache calls at admission), and last the real model in kvlab's engine:
# it evicts blocks from some groups, asks your rule what the next prompt hits in the
# groups' indexes, and compares with the prefix-hit tokens the engine then reports.

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
from kvlab.cache.groups import KVCacheGroup  # .window: None (full attention), or W tokens
from kvlab.labs import check_cross_group_hit, groups_of, kvlab_cross_group_hit
from kvlab.units import ceil_div  # noqa: F401 (ceil_div(n, d): the smallest integer >= n / d)

# %% [markdown]
# ## The exercise
#
# * `groups`: the model's KV cache groups, full-attention ones first; `groups[g].window`
#   is None for full attention, else the window `W` in tokens (at least 2);
# * `cached(g, i)`: whether group `g` holds block `i` of the prompt (its chained key is in
#   the group's prefix index); ask it only about blocks `0 .. num_blocks - 1`;
# * `num_blocks`: the most blocks the hit may take; `block_size`: tokens per block.
#
# Return the hit in blocks, `0 .. num_blocks`.


# %% nbgrader={"grade": false, "grade_id": "exercise", "locked": false, "schema_version": 3, "solution": true, "task": false}
# EXERCISE: fill in every TODO, then run this cell.
def cross_group_hit(groups: list[KVCacheGroup], cached, num_blocks: int, block_size: int) -> int:
    """The longest prefix hit, in blocks, that every group serves."""
    # TODO: the full groups: the hit ends at the first block one of them lacks
    # TODO: each window: move the hit left to the longest hit <= it whose last
    #       ceil_div(W - 1, block_size) blocks the group holds (from block 0 if shorter);
    #       repeat over the windows until none moves it
    ### BEGIN SOLUTION
    hit = num_blocks
    for g, group in enumerate(groups):
        if group.window is None:
            hit = next((i for i in range(hit) if not cached(g, i)), hit)
    moved = True
    while moved:
        moved = False
        for g, group in enumerate(groups):
            if group.window is None:
                continue
            need, h = ceil_div(group.window - 1, block_size), hit
            while h > 0:
                lacking = [i for i in range(max(0, h - need), h) if not cached(g, i)]
                if not lacking:
                    break
                h = lacking[-1]  # every hit longer than a block it lacks needs that block
            moved, hit = moved or h != hit, h
    return hit
    ### END SOLUTION


# %% [markdown]
# ## Try it
#
# The worked example: a full group, windows of 32 and 48 tokens, a hit of at most 7 blocks.

# %% tags=["raises-exception"]
groups = groups_of(None, 32, 48)
held = [{0, 1, 2, 3, 4, 5, 6}, {0, 1, 2, 5, 6}, {0, 1, 2, 3}]  # the blocks each group holds
print("your hit:   ", cross_group_hit(groups, lambda g, i: i in held[g], 7, 16))
print("kvlab's hit:", kvlab_cross_group_hit(groups, lambda g, i: i in held[g], 7, 16))

# %% [markdown]
# ## Grade it
#
# The grader prints one line when every check passes; otherwise the first broken
# rule, the smallest input that breaks it, and what was expected. Its last check loads
# SmolLM2-135M and serves it in kvlab's engine (a few seconds on a laptop's CPU).

# %% nbgrader={"grade": false, "grade_id": "grader", "locked": true, "schema_version": 3, "solution": false, "task": false}
result = check_cross_group_hit(cross_group_hit)

# %% [markdown]
# ## The checks, one cell each
#
# Each cell below passes if the grader's check of that name passed; if not, it raises
# `LabFailure` with that check's report (the broken invariant, the smallest failing input,
# what was expected). Under nbgrader each of these cells is autograded and worth the points
# it names, so a partly right answer gets partial marks; the cells are locked. When your lab
# is graded, each cell also runs its check on random cases this notebook does not show
# (hidden tests): code that passes only the cases shown here loses those points.

# %% nbgrader={"grade": true, "grade_id": "check_full_attention_only", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 1 point: the check "full attention only".
# Graded also on random cases not shown here (hidden tests).
### BEGIN HIDDEN TESTS
hidden = check_cross_group_hit(cross_group_hit, verbose=False, seed=2026)
### END HIDDEN TESTS
result.raise_for_check("full attention only")
### BEGIN HIDDEN TESTS
hidden.raise_for_check("full attention only")
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "check_sliding_windows_only", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 2 points: the check "sliding windows only".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("sliding windows only")
### BEGIN HIDDEN TESTS
hidden.raise_for_check("sliding windows only")
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "check_a_window_s_run_forces_the_hit_left", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 2 points: the check "a window's run forces the hit left".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("a window's run forces the hit left")
### BEGIN HIDDEN TESTS
hidden.raise_for_check("a window's run forces the hit left")
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "check_two_windows_move_each_other", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 2 points: the check "two windows move each other".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("two windows move each other")
### BEGIN HIDDEN TESTS
hidden.raise_for_check("two windows move each other")
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "check_no_hit", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 1 point: the check "no hit".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("no hit")
### BEGIN HIDDEN TESTS
hidden.raise_for_check("no hit")
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "check_random_groups_vs_kvlab_s_cross_group_hit", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 1 point: the check "random groups vs kvlab's cross_group_hit".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("random groups vs kvlab's cross_group_hit")
### BEGIN HIDDEN TESTS
hidden.raise_for_check("random groups vs kvlab's cross_group_hit")
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "check_the_hit_kvlab_s_engine_serves", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 1 point: the check "the hit kvlab's engine serves".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("the hit kvlab's engine serves")
### BEGIN HIDDEN TESTS
hidden.raise_for_check("the hit kvlab's engine serves")
### END HIDDEN TESTS

# %% [markdown]
# ## What the grader checks
#
# That the function returns a whole number of blocks from 0 to `num_blocks` and asks
# `cached` only about the groups given and blocks below `num_blocks`; full-attention
# groups alone (the hit ends at the first block one lacks); windows alone (a gap before a
# window's reach does not stop the hit, `W - 1` tokens at the window's edge, a hit shorter
# than the reach); a window that forces the hit below the full groups' bound; two windows
# that move each other until both serve the hit; hits of 0 blocks; 300 random cases
# against `kvlab_cross_group_hit`; and SmolLM2-135M in kvlab's engine with Gemma 3's
# pattern (`attention_pattern="window=32*5,full"`: 6 groups, block size 16), where blocks
# are evicted from some groups between prompts: your hit, asked of the groups' prefix
# indexes as they were when the prompt came, must be the hit the engine served.
#
# ## What to try next
#
# * A window of `W` tokens needs `ceil((W - 1) / block_size)` blocks, not
#   `ceil(W / block_size)`. For which windows do the two differ at block size 16? Do they
#   for Gemma 3's window of 1024 tokens?
# * With one full group and one window, a single pass over the windows is enough (vLLM's
#   coordinator calls this a "simple hybrid"). Why? Which of the checks' cases needs a
#   second pass?
# * kvlab's LRU holds a sliding group's blocks from the step its window leaves them, the
#   full group's only from the end of the request. Which group's blocks of a long prompt
#   does the LRU evict first, and what does that do to the next hit on that prompt?
