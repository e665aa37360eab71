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
# # Lab 7 · A tier's eviction and promotion: the host tier's LRU
#
# Notebook 10 sends cached blocks down a hierarchy: when the device pool evicts a cached
# block, its stored codes go to the **host tier** (host memory, bounded), and when that is
# full, its least recently used entry goes one tier further down (disk). A later request
# whose prefix matches finds the block there and promotes it back up.
#
# The bookkeeping of one tier is a bounded table, block key -> (salt, stored codes), kept
# in least-recently-used order:
#
# * `put(key, salt, value)` stores a block as the **most recently used** entry. If the tier
#   would then hold more than `capacity_blocks` entries, it evicts the **least recently
#   used** ones and **returns** them, `(key, salt, value)` each, so the stack can write them
#   to the next tier (dropping them would lose the block for good). A put of a key already
#   held stores nothing new (a key's codes never change): it only makes it most recent.
# * `get(key, salt)` is a lookup. A **hit** returns the value and makes the entry most
#   recently used; an absent key is a **miss** (None). An entry stored under **another
#   salt** (another tenant) is never served: None, counted as **refused** (not a miss), and
#   the entry does not become recent: nobody used it.
# * The counts: `hits`, `misses`, `refused`, `evictions`.
#
# kvlab's rule is its own host tier, `HostTier` (kvlab/cache/tiers/host.py; the salt check
# is `TableTier._lookup` in base.py). Keys here are short strings standing in for the
# chained block keys, values stand in for the stored codes.
#
# Your task: `get` and `put`. The grader checks crafted cases, then 200 random sequences of
# operations against kvlab's own tier, `KvlabHostTier`.

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
from collections import OrderedDict

from kvlab.labs import KvlabHostTier, check_tier_lru

# %% [markdown]
# ## The exercise
#
# `self.entries` is an `OrderedDict`: key -> `(salt, value)`, least recently used first.
# `self.entries.move_to_end(key)` makes `key` the most recently used;
# `self.entries.popitem(last=False)` removes and returns the least recently used
# `(key, (salt, value))`. `keys()` (given) lists the keys in that order: the grader reads it.


# %% nbgrader={"grade": false, "grade_id": "exercise", "locked": false, "schema_version": 3, "solution": true, "task": false}
# EXERCISE: fill in every TODO, then run this cell.
class LabHostTier:
    """A bounded tier of cached blocks: key -> (salt, value), least recently used first."""

    def __init__(self, capacity_blocks: int):
        self.capacity_blocks = capacity_blocks
        self.entries: OrderedDict = OrderedDict()  # key -> (salt, value), LRU first
        self.hits = self.misses = self.refused = self.evictions = 0

    def keys(self) -> list:
        return list(self.entries)

    def get(self, key, salt):
        """The value of `key` if it is held under `salt` (a hit: now most recent), else None."""
        # TODO: a miss, a refusal (another salt), or a hit that promotes the entry
        raise NotImplementedError

    def put(self, key, salt, value) -> list:
        """Store a block as the most recent entry; return the (key, salt, value) evicted."""
        # TODO: a key already held only becomes most recent; otherwise store it, then evict
        # least recently used entries while the tier holds more than capacity_blocks
        raise NotImplementedError


# %% [markdown]
# ## Try it
#
# A tier of 2 blocks: two blocks of tenant A, a lookup of the first (a hit), one under
# tenant B (refused), then a third block. Which one goes down to the next tier?

# %% tags=["raises-exception"]
for tier in (LabHostTier(2), KvlabHostTier(2)):
    tier.put("a", "tenant-a", "kv-a")
    tier.put("b", "tenant-a", "kv-b")
    print(type(tier).__name__, "get:", tier.get("a", "tenant-a"), tier.get("b", "tenant-b"))
    print("  evicted:", tier.put("c", "tenant-a", "kv-c"), "keys:", tier.keys())
    print("  counts:", {n: getattr(tier, n) for n in ("hits", "misses", "refused", "evictions")})

# %% [markdown]
# ## Grade it
#
# The grader prints one line when every check passes; otherwise the first broken
# rule, the smallest input that breaks it, and what was expected.

# %% nbgrader={"grade": false, "grade_id": "grader", "locked": true, "schema_version": 3, "solution": false, "task": false}
result = check_tier_lru(LabHostTier)

# %% [markdown]
# ## The checks, one cell each
#
# Each cell below passes if the grader's check of that name passed; if not, it raises
# `LabFailure` with that check's report (the broken invariant, the smallest failing input,
# what was expected). Under nbgrader each of these cells is autograded and worth the points
# it names, so a partly right answer gets partial marks; the cells are locked. When your lab
# is graded, each cell also runs its check on random cases this notebook does not show
# (hidden tests): code that passes only the cases shown here loses those points.

# %% nbgrader={"grade": true, "grade_id": "check_hits_and_misses", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 2 points: the check "hits and misses".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("hits and misses")

# %% nbgrader={"grade": true, "grade_id": "check_full_the_least_recently_used_goes_down", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 2 points: the check "full: the least recently used goes down".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("full: the least recently used goes down")

# %% nbgrader={"grade": true, "grade_id": "check_a_hit_is_promoted", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 2 points: the check "a hit is promoted".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("a hit is promoted")

# %% nbgrader={"grade": true, "grade_id": "check_another_salt_is_refused", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 2 points: the check "another salt is refused".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("another salt is refused")

# %% nbgrader={"grade": true, "grade_id": "check_random_operations_vs_kvlab_s_host_tier", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 2 points: the check "random operations vs kvlab's host tier".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("random operations vs kvlab's host tier")

# %% [markdown]
# ## What the grader checks
#
# That `put` returns a list of `(key, salt, value)` and `get` a value or None; hits and
# misses and their counts; eviction only once the tier would exceed its capacity, least
# recently used first, every evicted entry returned for the next tier; promotion by a hit
# and by a put of a key already held; refusal (not a miss, no promotion) under another
# salt; and 200 random sequences of puts and gets against kvlab's `HostTier`, comparing
# what each call returns, the keys in LRU order and the counts after every call.
#
# ## What to try next
#
# * kvlab's `HostTier` also *holds* swapped-out requests' blocks (`hold`, `release`): they
#   count against the capacity and push cached entries down. Read `_make_room` in
#   kvlab/cache/tiers/host.py: why is a hold never refused?
# * The disk tier (kvlab/cache/tiers/disk.py) keeps the same LRU order over files and
#   checks each one's checksum on `get`. What should a tier do with an entry whose
#   checksum fails: a miss, a refusal, or something else? Compare `TierStats.corrupt`.
# * Notebook 10's write policies decide *when* a block goes down (write-back on eviction,
#   or write-through at once). With write-through, what does an eviction from the host
#   tier cost?
