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
# # Lab 9 · The precise scorer: where is a request's prefix cached?
#
# Notebook 14 puts a router in front of several replicas of one engine. The router wins
# only if it sends each request to **the replica that already holds its prefix**, and it
# learns what each replica holds from the replicas' **KV events** (vLLM's
# `--kv-events-config`, which `kvlab serve` publishes the same way):
#
# * `BlockStored`: blocks became reusable; `block_hashes` lists their chained hashes,
#   first block first (`parent_block_hash` is the hash of the block before them, None when
#   they start a prompt), with their `token_ids` and `block_size`;
# * `BlockRemoved`: the replica evicted the blocks in `block_hashes`;
# * `AllBlocksCleared`: the replica reset its prefix cache.
#
# For a new request the router computes the request's own chain of block hashes (the
# same function the engines use: vLLM's `sha256_cbor`, so it needs no call to any
# replica) and asks, per replica: **how many of these blocks do you hold, in a row from
# the first?** An engine's lookup walks the chain from the first block and stops at the
# first miss, so a block held after a gap is of no use. That count is llm-d's *precise
# prefix-cache score* and the heart of NVIDIA Dynamo's KV router; the replica with the
# highest wins (a load guard aside).
#
# Your task: `LabScorer`, with `apply(replica, event)` and `score(hashes, replicas)`.
# The grader checks crafted event streams, random ones against kvlab's router index
# (`kvlab/route/index.py`), and finally three real `PagedCache`s whose events you read:
# your score must be exactly what each replica's own cache would hit.

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
from kvlab.labs import KvlabScorer, check_precise_scorer
from kvlab.labs.scorer import CLEAR, removed, stored

# %% [markdown]
# ## The exercise
#
# Events are dicts, as a subscriber decodes them from the wire (msgpack):
# `event["type"]` is `"BlockStored"`, `"BlockRemoved"` or `"AllBlocksCleared"`;
# `event["block_hashes"]` a list of integers. A dict of sets, replica -> hashes it holds,
# is all the state you need.


# %% nbgrader={"grade": false, "grade_id": "exercise", "locked": false, "schema_version": 3, "solution": true, "task": false}
# EXERCISE: fill in every TODO, then run this cell.
class LabScorer:
    """Which block hashes each replica holds, from its KV events; the longest cached
    prefix of a request per replica."""

    def __init__(self):
        self.held: dict[str, set[int]] = {}  # replica -> block hashes it holds

    def apply(self, replica: str, event: dict) -> None:
        """Follow one event of `replica`."""
        # TODO: BlockStored adds its block_hashes to the replica's set, BlockRemoved takes
        #       them out (of that replica's set only), AllBlocksCleared empties that set
        raise NotImplementedError

    def score(self, hashes: list[int], replicas: list[str]) -> dict[str, int]:
        """For each replica in `replicas`: how many of `hashes` it holds from the first on,
        stopping at the first it lacks."""
        # TODO: walk the request's hashes in order for each replica; a replica that never
        #       sent an event holds nothing
        raise NotImplementedError


# %% [markdown]
# ## Try it
#
# Replica r0 stored a prompt of three blocks (hashes 1, 2, 3), r1 only its first two,
# then r0 evicted block 2. A request whose chain is 1, 2, 3, 4: where would you send it?

# %% tags=["raises-exception"]
for scorer in (LabScorer(), KvlabScorer()):
    scorer.apply("r0", stored([1, 2, 3]))
    scorer.apply("r1", stored([1, 2]))
    print(type(scorer).__name__, scorer.score([1, 2, 3, 4], ["r0", "r1", "r2"]), end="  ")
    scorer.apply("r0", removed([2]))
    print("after r0 evicts block 2:", scorer.score([1, 2, 3, 4], ["r0", "r1", "r2"]), end="  ")
    scorer.apply("r1", CLEAR)
    print("after r1 resets:", scorer.score([1, 2, 3, 4], ["r0", "r1", "r2"]))

# %% [markdown]
# ## Grade it
#
# The grader prints one line when every check passes; otherwise the first broken
# rule, the smallest input that breaks it, and what was expected.

# %% nbgrader={"grade": false, "grade_id": "grader", "locked": true, "schema_version": 3, "solution": false, "task": false}
result = check_precise_scorer(LabScorer)

# %% [markdown]
# ## The checks, one cell each
#
# Each cell below passes if the grader's check of that name passed; if not, it raises
# `LabFailure` with that check's report (the broken invariant, the smallest failing input,
# what was expected). Under nbgrader each of these cells is autograded and worth the points
# it names, so a partly right answer gets partial marks; the cells are locked. When your lab
# is graded, each cell also runs its check on random cases this notebook does not show
# (hidden tests): code that passes only the cases shown here loses those points.

# %% nbgrader={"grade": true, "grade_id": "check_a_stored_chain_is_found", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 1 point: the check "a stored chain is found".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("a stored chain is found")

# %% nbgrader={"grade": true, "grade_id": "check_the_prefix_stops_at_the_first_missing_block", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 1 point: the check "the prefix stops at the first missing block".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("the prefix stops at the first missing block")

# %% nbgrader={"grade": true, "grade_id": "check_every_replica_scored_on_its_own_blocks", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 1 point: the check "every replica scored on its own blocks".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("every replica scored on its own blocks")

# %% nbgrader={"grade": true, "grade_id": "check_blockremoved_forgets_one_replica_s_block", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 2 points: the check "BlockRemoved forgets one replica's block".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("BlockRemoved forgets one replica's block")

# %% nbgrader={"grade": true, "grade_id": "check_allblockscleared_resets_one_replica", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 1 point: the check "AllBlocksCleared resets one replica".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("AllBlocksCleared resets one replica")

# %% nbgrader={"grade": true, "grade_id": "check_random_event_streams_the_same_scores_as_kvlab_s_index", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 2 points: the check "random event streams: the same scores as kvlab's index".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("random event streams: the same scores as kvlab's index")

# %% nbgrader={"grade": true, "grade_id": "check_real_replicas_the_score_is_what_each_cache_would_hit", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 2 points: the check "real replicas: the score is what each cache would hit".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("real replicas: the score is what each cache would hit")

# %% [markdown]
# ## What the grader checks
#
# A stored chain is found from its first block; a replica's count stops at its first
# missing block; every replica asked about is scored, on its own blocks only; a removal
# and a reset touch one replica; on random event streams your scores equal kvlab's router
# index; and on three real `PagedCache`s (vLLM's block hashes, random traffic, evictions)
# your score for a request is exactly each cache's own prefix hit.
#
# ## What to try next
#
# * The events say nothing about load: a replica holding every prefix would get every
#   request. Add a **load guard** as `kvlab/route/policies.py` does (only replicas with at
#   most `load_guard` more requests in flight than the least busy one compete on prefix).
# * `BlockStored` carries `parent_block_hash`: keep the parent of each block and you can
#   draw each replica's cache as a tree (notebook 14's index table does).
# * vLLM emits `BlockStored` again when two requests compute the same block in one step
#   (its pool keeps duplicates), and one `BlockRemoved` per copy evicted. With a set per
#   replica, the first removal forgets a block the replica still holds: how would you
#   count copies instead?
