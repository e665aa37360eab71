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
# # Lab 2 · The chained block hash
#
# With prefix caching, a new request reuses the K/V blocks of an earlier request whose
# prompt starts the same way. vLLM finds them with a **hash per full block**: block *i*'s
# key is a hash of
#
# * the key of block *i − 1* (the **parent**): K/V at a position depend on *every* earlier
#   token, so the same 16 tokens after a different beginning must get a different key;
# * the token ids of block *i*;
# * a **salt** (tenant, or cache version): requests with different salts must never share
#   K/V, even for identical prompts (a shared cache leaks timing information across users,
#   and a new model or system-prompt version must not read stale K/V).
#
# A lookup walks the prompt's keys from the first block and stops at the first miss. Only
# **full** blocks get a key: a partly filled last block will still change.
#
# Your task: `block_keys(tokens, block_size, salt)`, the list of keys of the full blocks.
# The grader checks the properties above with crafted pairs, compares with kvlab's
# `HashPrefixIndex` on random prompts, then serves random traffic through kvlab's
# `PagedCache` with your keys in its index.

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
import hashlib  # noqa: F401 (for your hash)

from kvlab.labs import check_block_hash

# %% [markdown]
# ## The exercise
#
# Useful: `hashlib.blake2b(parent, digest_size=16)` starts a digest from the parent's key
# (`b""` for the first block); `digest.update(data)` adds bytes; `digest.digest()` is the
# key. `token.to_bytes(8, "little", signed=True)` turns a token id into 8 bytes.


# %% nbgrader={"grade": false, "grade_id": "exercise", "locked": false, "schema_version": 3, "solution": true, "task": false}
# EXERCISE: fill in every TODO, then run this cell.
def block_keys(tokens: list[int], block_size: int, salt: str | None) -> list[bytes]:
    """One key per *full* block: key_i = H(key_{i-1}, tokens of block i, salt)."""
    # TODO: for each full block of `tokens` (a partly filled last block gets no key), hash
    #       the previous block's key, this block's tokens and the salt into one key.
    raise NotImplementedError


# %% [markdown]
# ## Try it

# %% tags=["raises-exception"]
system = [1, 2, 3, 4, 5, 6, 7, 8]  # a shared system prompt: two blocks of 4
a = block_keys(system + [10, 11, 12, 13, 14], 4, None)
b = block_keys(system + [20, 21, 22, 23], 4, None)
c = block_keys(system + [10, 11, 12, 13], 4, "tenant-b")
print("keys:", len(a), len(b), len(c))
print("a and b share:", [x == y for x, y in zip(a, b)])
print("a and c (another tenant) share:", [x == y for x, y in zip(a, c)])

# %% [markdown]
# ## Grade it
#
# The grader prints one line when every check passes; otherwise the first broken
# rule, the smallest input that breaks it, and what was expected.

# %% nbgrader={"grade": false, "grade_id": "grader", "locked": true, "schema_version": 3, "solution": false, "task": false}
result = check_block_hash(block_keys)

# %% [markdown]
# ## The checks, one cell each
#
# Each cell below passes if the grader's check of that name passed; if not, it raises
# `LabFailure` with that check's report (the broken invariant, the smallest failing input,
# what was expected). Under nbgrader each of these cells is autograded and worth the points
# it names, so a partly right answer gets partial marks; the cells are locked. When your lab
# is graded, each cell also runs its check on random cases this notebook does not show
# (hidden tests): code that passes only the cases shown here loses those points.

# %% nbgrader={"grade": true, "grade_id": "check_one_key_per_full_block", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 1 point: the check "one key per full block".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("one key per full block")

# %% nbgrader={"grade": true, "grade_id": "check_same_prefix_same_keys", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 1 point: the check "same prefix, same keys".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("same prefix, same keys")

# %% nbgrader={"grade": true, "grade_id": "check_chained_earlier_blocks_change_the_key", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 2 points: the check "chained: earlier blocks change the key".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("chained: earlier blocks change the key")

# %% nbgrader={"grade": true, "grade_id": "check_no_collisions_between_different_blocks", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 2 points: the check "no collisions between different blocks".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("no collisions between different blocks")

# %% nbgrader={"grade": true, "grade_id": "check_salts_keep_tenants_apart", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 2 points: the check "salts keep tenants apart".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("salts keep tenants apart")

# %% nbgrader={"grade": true, "grade_id": "check_random_prompts_equal_keys_exactly_where_kvlab_s_are", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 1 point: the check "random prompts: equal keys exactly where kvlab's are".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("random prompts: equal keys exactly where kvlab's are")

# %% nbgrader={"grade": true, "grade_id": "check_inside_pagedcache_prompts_and_tenants_stay_separate", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 1 point: the check "inside PagedCache: prompts and tenants stay separate".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("inside PagedCache: prompts and tenants stay separate")

# %% [markdown]
# ## What the grader checks
#
# One key per full block; the same prefix always gives the same keys (later tokens change
# nothing); a block after a different parent gets a different key; no collisions between
# blocks that naive hashing confuses (reordered tokens, equal sums, `"1"+"23"` vs
# `"12"+"3"`, ids past 255 or 65,535); different salts never share a key; on random prompts
# your keys are equal exactly where kvlab's are; and inside `PagedCache` no request ever
# reads K/V of another prefix or tenant.
#
# ## What to try next
#
# * Hash with Python's `hash((parent, tuple(block), salt))`. Does it pass? It is fast, but
#   `hash()` of a `str` changes from one process to the next (`PYTHONHASHSEED`), so a
#   cache shared by several processes would never hit. vLLM offers SHA-256 for that reason
#   and because a collision would silently serve one request another's K/V.
# * vLLM puts the salt into the **first** block's key only. Why is that enough?
# * Compare with the radix tree of `RadixPrefixIndex` (SGLang's design): it matches token
#   by token and needs no hash at all.
