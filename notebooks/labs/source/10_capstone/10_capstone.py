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
# # Lab 10 · Capstone: your parts serve the real model
#
# In the labs so far each part you wrote was graded on its own. Here three of them run
# *together*, inside kvlab's engine, serving SmolLM2-135M:
#
# * your **block allocator** (lab 1) hands out every KV block of the engine's `PagedCache`;
# * your **block hash** (lab 2) keys every full block in its prefix index, so it decides
#   which prompt tokens are served from the prefix cache;
# * your **victim rule** (lab 4) picks the request the scheduler preempts when the blocks
#   run out.
#
# `kvlab.labs.capstone.plug_in(engine, make_allocator, block_keys, choose_victim)` puts them
# where kvlab's own parts sit, before the engine serves its first request. The grader then
# serves a workload twice, with your parts and with kvlab's: three users ask about one
# document over three turns (each turn's prompt is the conversation so far, so it finds its
# history in the prefix cache), another tenant (a salt) sends user a's first prompt, one
# request is a's first prompt without its second block (the same blocks, each one position
# earlier: none of them may be served from the cache), and the KV budget (26 blocks of 16
# tokens) is too small for everyone, so cached blocks are evicted and requests preempted.
#
# It compares request by request: the **greedy tokens** (kvlab's engine's, each of which the
# grader checks is HF transformers' greedy pick; kvlab's equal vLLM's on the vLLM oracle's
# shared-prefix workloads, `tests/test_vllm_oracle.py`), the **prompt tokens served from the
# prefix cache**, the **preemptions**; that the engine's own rules hold after every step; and
# that no block is **leaked** once every request has finished.
#
# Run the set-up cell, fill in the TODOs, run the "try it" cell, then the grader and the
# check cells after it.

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
from collections.abc import Callable

from kvlab import Engine, SamplingParams
from kvlab.labs import check_capstone
from kvlab.labs.capstone import capstone_config, capstone_model, plug_in

# %% [markdown]
# ## The exercise
#
# Bring your answers: paste your `LabBlockAllocator` class (lab 1), your `block_keys`
# function (lab 2) and your `choose_victim` function (lab 4) into the cell below, and make
# the three functions return them (or call them). The grader calls
# `make_allocator(num_blocks, on_evict)` once per engine: the cache's `on_evict` tells its
# prefix index that an evicted block's contents are gone.


# %% nbgrader={"grade": false, "grade_id": "exercise", "locked": false, "schema_version": 3, "solution": true, "task": false}
# EXERCISE: fill in every TODO, then run this cell.
def make_allocator(num_blocks: int, on_evict: Callable[[int], None] | None):
    """Lab 1: a block allocator of `num_blocks` blocks that calls `on_evict(block)`."""
    # TODO: paste your LabBlockAllocator class from lab 1 above this function and
    #       return LabBlockAllocator(num_blocks, on_evict)
    ### BEGIN SOLUTION
    from kvlab.cache import BlockAllocator  # kvlab's own, in place of lab 1's answer

    return BlockAllocator(num_blocks, on_evict)
    ### END SOLUTION


def block_keys(tokens: list[int], block_size: int, salt: str | None) -> list:
    """Lab 2: one key per full block, key_i = H(key_{i-1}, tokens of block i, salt)."""
    # TODO: paste the body of your block_keys from lab 2 (and `import hashlib` at the top
    #       of this cell)
    ### BEGIN SOLUTION
    from kvlab.labs import kvlab_block_keys  # kvlab's own, in place of lab 2's answer

    return kvlab_block_keys(tokens, block_size, salt)
    ### END SOLUTION


def choose_victim(running: list):
    """Lab 4: the running sequence to preempt."""
    # TODO: paste the body of your choose_victim from lab 4
    ### BEGIN SOLUTION
    from kvlab.engine.scheduler import choose_victim as kvlab_choose_victim

    return kvlab_choose_victim(running)  # kvlab's own, in place of lab 4's answer
    ### END SOLUTION


# %% [markdown]
# ## Try it
#
# An engine with your parts plugged in answers one question, then the same question
# again: the second time its prompt's full blocks come from the prefix cache (your keys
# found them, your allocator kept them).

# %% tags=["raises-exception"]
model = capstone_model()  # SmolLM2-135M on the CPU, float32 (the grader's model)
engine = Engine(model, capstone_config())
plug_in(engine, make_allocator, block_keys, choose_victim)
question = ["What is the capital of France? Answer in one sentence."]
for turn in range(2):
    out = engine.generate(question, SamplingParams(max_new_tokens=12))[0]
    hit, total = out.metrics.prefix_hit_tokens, len(out.prompt_token_ids)
    print(f"ask {turn + 1}: {hit} of {total} prompt tokens from the cache -> {out.text!r}")
print("blocks in use after both:", engine.cache.allocator.num_used)

# %% [markdown]
# ## Grade it
#
# The grader prints one line when every check passes; otherwise the first broken
# rule, the smallest workload that breaks it (and the call that serves only that
# workload), and what was expected.

# %% nbgrader={"grade": false, "grade_id": "grader", "locked": true, "schema_version": 3, "solution": false, "task": false}
result = check_capstone(make_allocator, block_keys, choose_victim)

# %% [markdown]
# ## The checks, one cell each
#
# Each cell below passes if the grader's check of that name passed; if not, it raises
# `LabFailure` with that check's report (the broken invariant, the smallest failing input,
# what was expected). Under nbgrader each of these cells is autograded and worth the points
# it names, so a partly right answer gets partial marks; the cells are locked. When your lab
# is graded, each cell also runs its check on a workload this notebook does not show
# (hidden tests: other questions and priorities).

# %% nbgrader={"grade": true, "grade_id": "check_the_engine_s_rules_hold_after_every_step", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 2 points: the check "the engine's rules hold after every step".
# Graded also on random cases not shown here (hidden tests).
### BEGIN HIDDEN TESTS
hidden = check_capstone(make_allocator, block_keys, choose_victim, verbose=False, seed=2026)
### END HIDDEN TESTS
result.raise_for_check("the engine's rules hold after every step")
### BEGIN HIDDEN TESTS
hidden.raise_for_check("the engine's rules hold after every step")
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "check_greedy_tokens_equal_the_reference", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 2 points: the check "greedy tokens equal the reference".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("greedy tokens equal the reference")
### BEGIN HIDDEN TESTS
hidden.raise_for_check("greedy tokens equal the reference")
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "check_preemptions_per_request_equal_kvlab_s", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 1 point: the check "preemptions per request equal kvlab's".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("preemptions per request equal kvlab's")
### BEGIN HIDDEN TESTS
hidden.raise_for_check("preemptions per request equal kvlab's")
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "check_prefix_cache_hits_per_request_equal_kvlab_s", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 2 points: the check "prefix-cache hits per request equal kvlab's".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("prefix-cache hits per request equal kvlab's")
### BEGIN HIDDEN TESTS
hidden.raise_for_check("prefix-cache hits per request equal kvlab's")
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "check_no_leaked_blocks_at_the_end", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 1 point: the check "no leaked blocks at the end".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("no leaked blocks at the end")
### BEGIN HIDDEN TESTS
hidden.raise_for_check("no leaked blocks at the end")
### END HIDDEN TESTS

# %% [markdown]
# ## What the grader checks
#
# The engine's own rules after every step (`PagedCache.check_integrity()`: reference counts
# equal block-table references, no block shared across salts, every cached block in the
# prefix index); the greedy tokens of every request; the prompt tokens each request is
# served from the prefix cache and how often it is preempted, against the same workload on
# kvlab's own parts; and that every block is free or cached at the end. A wrong hash serves
# one request another prefix's K/V (its tokens change) or shares a block across tenants; a
# wrong allocator loses blocks or evicts the wrong ones (fewer hits later); a wrong victim
# rule preempts another request than kvlab's scheduler would.
#
# Where your parts sit in the engine: `plug_in` replaces three attributes,

# %%
from kvlab.course import show_source  # noqa: E402

show_source(plug_in, "cache.allocator =", "engine.scheduler.choose_victim")

# %% [markdown]
# and the scheduler asks the victim rule whenever a running request's next tokens need more
# blocks than are left (`allocate_slots` returns None):

# %%
from kvlab.engine.scheduler import Scheduler  # noqa: E402

show_source(Scheduler._secure_blocks, "while self.cache.allocate_slots", "if victim is seq")

# %% [markdown]
# ## What to try next
#
# * `kvlab.labs.capstone.capstone_workload(model)` is the workload and kvlab's own serve of
#   it; `serve(model, requests, parts)` serves any part of it with your parts. Which
#   requests are preempted, and which find fewer cached blocks, if your allocator evicts the
#   *most* recently used block?
# * Change `choose_victim` to preempt the *oldest* request. The grader names the first
#   preemption where your rule and kvlab's differ; what does kvlab's scheduler assume?
