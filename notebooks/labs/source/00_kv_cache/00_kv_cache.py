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
# # Lab 0 · The KV cache of one attention layer
#
# Notebook 01 decoded with and without a cache. Here you write the cache: the part of one
# attention layer that keeps the keys and values of every token so far, and the attention
# of the new tokens' queries over them. The grader then runs the real model, SmolLM2-135M,
# with one of your caches in each of its 30 layers and compares its logits with the
# model's forward pass over the whole text without any cache.
#
# **Why a cache works.** In each layer, token `j` gets a query `q_j`, a key `k_j` and a
# value `v_j` (per head). The output of the token at position `p` is
# `softmax(q_p · k_j / √head_dim)` over the positions `j ≤ p`, weighting the `v_j`. The
# mask means `k_j` and `v_j` depend only on token `j` and the tokens before it, never on
# later ones: once computed they never change. So keep them, and a new token computes only
# its own `q`, `k` and `v`, then attends over the kept ones.
#
# **One layer's cache** holds `k` and `v`, each `(T, num_kv_heads, head_dim)` for the `T`
# tokens cached so far, and grows two ways:
#
# * a **prompt** (prefill): `n` tokens appended at once. They are the **last** `n` of the
#   `T` cached, so query `i` (at position `T - n + i`) sees positions `0 .. T - n + i`:
#   the causal mask of an `n × T` score matrix, aligned to its bottom-right corner;
# * **decoding**: one token per step (`n = 1`): it sees every cached token.
#
# **Grouped-query attention (GQA).** SmolLM2-135M has 9 query heads but only 3 KV heads:
# query heads 0-2 read KV head 0, heads 3-5 KV head 1, heads 6-8 KV head 2, so head `h`
# reads KV head `h // (num_heads // num_kv_heads)` (transformers' `repeat_kv` does the
# same). Its cache is 3 times smaller than with one KV head per query head.
#
# The shapes are kvlab's (the engine packs tokens along the first dimension): `q` is
# `(n, num_heads, head_dim)`, `k` and `v` are `(n, num_kv_heads, head_dim)`, and the
# output is `(n, num_heads, head_dim)`. Scores are scaled by `1 / √head_dim` (head_dim 64
# in SmolLM2: 1/8).
#
# Your task: `append` and `attend`. The grader checks shapes, appends one token at a time
# and several at once, the causal mask within an append, GQA's head mapping against
# kvlab's own cache (`KvlabKVCache`: a `KVPool` read by `pooled_attention`), and last the
# real model's logits.

# %% nbgrader={"grade": false, "grade_id": "setup", "locked": true, "schema_version": 3, "solution": false, "task": false}
import torch

from kvlab.labs import (
    KvlabKVCache,
    check_kv_cache,
    generate_with_cache,
    generate_without_cache,
    kv_inputs,
)

# %% [markdown]
# ## The exercise
#
# Useful: `torch.cat((a, b))` (along dim 0), `x.repeat_interleave(g, dim=1)` (each head
# `g` times in a row: 0, 0, 1, 1, ...), `torch.einsum("nhd,thd->hnt", q, k)` (every
# query with every cached key, per head; or `matmul` after `transpose`),
# `scores.masked_fill(mask, float("-inf"))`, `.softmax(dim=-1)`, `torch.arange`.


# %% nbgrader={"grade": false, "grade_id": "exercise", "locked": false, "schema_version": 3, "solution": true, "task": false}
# EXERCISE: fill in every TODO, then run this cell.
class LabKVCache:
    """One attention layer's KV cache: K and V of every token so far, and attention over them."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype=torch.float32):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.k = torch.empty(0, num_kv_heads, head_dim, dtype=dtype)  # (T, kv_heads, head_dim)
        self.v = torch.empty(0, num_kv_heads, head_dim, dtype=dtype)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Cache the n new tokens' K and V, each (n, num_kv_heads, head_dim), after those cached."""
        # TODO: keep every token cached so far, then the n new ones
        ### BEGIN SOLUTION
        self.k = torch.cat((self.k, k))
        self.v = torch.cat((self.v, v))
        ### END SOLUTION

    def attend(self, q: torch.Tensor) -> torch.Tensor:
        """q: the queries of the last n tokens appended, (n, num_heads, head_dim).
        Returns their attention over every cached token, (n, num_heads, head_dim)."""
        # TODO: 1. GQA: query head h reads KV head h // (num_heads // num_kv_heads): repeat
        #          each KV head for its group of query heads, K and V alike.
        #       2. scores: q . k / sqrt(head_dim) for each head, query (n) and cached token (T).
        #       3. causal: the new tokens are the last n of the T cached; query i (position
        #          T - n + i) sees positions 0 .. T - n + i: the other scores become -inf.
        #       4. softmax over the cached tokens, then the weighted sum of V.
        ### BEGIN SOLUTION
        n, total = q.shape[0], self.k.shape[0]
        group = self.num_heads // self.num_kv_heads
        k = self.k.repeat_interleave(group, dim=1)  # (T, num_heads, head_dim)
        v = self.v.repeat_interleave(group, dim=1)
        scores = torch.einsum("nhd,thd->hnt", q, k) * self.head_dim**-0.5  # (heads, n, T)
        position = torch.arange(total - n, total)[:, None]  # each query's position
        scores = scores.masked_fill(torch.arange(total)[None, :] > position, float("-inf"))
        return torch.einsum("hnt,thd->nhd", scores.softmax(dim=-1), v)
        ### END SOLUTION


# %% [markdown]
# ## Try it
#
# Three tokens through one layer of SmolLM2's shape (9 query heads, 3 KV heads, head_dim
# 64): two appended at once, then one; your cache beside kvlab's. Then the real model, 30
# layers, one of your caches in each: the prompt appended at once, then each new token
# alone, against the model run over the whole text at every step without any cache.

# %% tags=["raises-exception"]
q, k, v = kv_inputs(3, num_heads=9, num_kv_heads=3, head_dim=64)
mine, kvlabs = LabKVCache(9, 3, 64), KvlabKVCache(9, 3, 64)
for new in (slice(0, 2), slice(2, 3)):  # two tokens at once, then one
    for cache in (mine, kvlabs):
        cache.append(k[new], v[new])
    out = mine.attend(q[new])
    same = torch.allclose(out, kvlabs.attend(q[new]), atol=1e-5)
    print(f"cached K {tuple(mine.k.shape)}, attend -> {tuple(out.shape)}, same as kvlab's: {same}")

prompt = "Once upon a time, a little robot"
print(f"\n{prompt!r} continued by SmolLM2-135M, greedy:")
print("  through your caches:", repr(generate_with_cache(LabKVCache, prompt, 12)))
print("  without any cache:  ", repr(generate_without_cache(prompt, 12)))

# %% [markdown]
# ## Grade it
#
# The grader prints one line when every check passes; otherwise the first broken
# rule, the smallest input that breaks it, and what was expected. It loads the model once
# (a few seconds).

# %% nbgrader={"grade": false, "grade_id": "grader", "locked": true, "schema_version": 3, "solution": false, "task": false}
result = check_kv_cache(LabKVCache)

# %% [markdown]
# ## The checks, one cell each
#
# Each cell below passes if the grader's check of that name passed; if not, it raises
# `LabFailure` with that check's report (the broken invariant, the smallest failing input,
# what was expected). Under nbgrader each of these cells is autograded and worth the points
# it names, so a partly right answer gets partial marks; the cells are locked. When your lab
# is graded, each cell also runs its check on random cases this notebook does not show
# (hidden tests): code that passes only the cases shown here loses those points.

# %% nbgrader={"grade": true, "grade_id": "check_shapes_and_dtypes", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 1 point: the check "shapes and dtypes".
# Graded also on random cases not shown here (hidden tests).
### BEGIN HIDDEN TESTS
hidden = check_kv_cache(LabKVCache, verbose=False, seed=2026)
### END HIDDEN TESTS
result.raise_for_check("shapes and dtypes")
### BEGIN HIDDEN TESTS
hidden.raise_for_check("shapes and dtypes")
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "check_appends_one_token_at_a_time", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 2 points: the check "appends one token at a time".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("appends one token at a time")
### BEGIN HIDDEN TESTS
hidden.raise_for_check("appends one token at a time")
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "check_causal_mask_within_an_append", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 2 points: the check "causal mask within an append".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("causal mask within an append")
### BEGIN HIDDEN TESTS
hidden.raise_for_check("causal mask within an append")
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "check_appends_several_tokens_at_once", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 1 point: the check "appends several tokens at once".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("appends several tokens at once")
### BEGIN HIDDEN TESTS
hidden.raise_for_check("appends several tokens at once")
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "check_gqa_query_heads_share_kv_heads", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 2 points: the check "GQA: query heads share KV heads".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("GQA: query heads share KV heads")
### BEGIN HIDDEN TESTS
hidden.raise_for_check("GQA: query heads share KV heads")
### END HIDDEN TESTS

# %% nbgrader={"grade": true, "grade_id": "check_smollm2_s_logits_through_your_cache", "locked": true, "points": 2, "schema_version": 3, "solution": false, "task": false} tags=["raises-exception"]
# Autograded, 2 points: the check "SmolLM2's logits through your cache".
# Graded also on random cases not shown here (hidden tests).
result.raise_for_check("SmolLM2's logits through your cache")
### BEGIN HIDDEN TESTS
hidden.raise_for_check("SmolLM2's logits through your cache")
### END HIDDEN TESTS

# %% [markdown]
# ## What the grader checks
#
# Shapes and dtypes (`k` and `v` of `(T, num_kv_heads, head_dim)`, an output of
# `(n, num_heads, head_dim)` in `q`'s dtype); one token at a time: `k` and `v` keep every
# token appended, and each query attends over all of them with the `1 / √head_dim` scale;
# the causal mask within an append, into an empty cache and into one already holding
# tokens; random sequences of appends of 1-5 tokens, the failing one cut down to the
# fewest appends; 9 query heads over 3 KV heads (and 4 over 2, and 4 over 1); and last,
# SmolLM2-135M run through 30 of your caches, a few tokens at once and then one at a time,
# within 0.002 of the logits of its forward pass over the whole text without a cache, at
# every position. The small checks compare with kvlab's own cache, `KvlabKVCache`.
#
# ## What to try next
#
# * Time `generate_with_cache(LabKVCache, prompt, 64)` against
#   `generate_without_cache(prompt, 64)`. Which one's time per token grows with the text,
#   and why? (Notebook 01 measures it.)
# * How many bytes does one token take in your 30 caches, in float32? How many would it
#   take if SmolLM2 had one KV head per query head?
# * `torch.cat` copies the whole cache at every append: appending `T` tokens one by one
#   copies about `T² / 2` token rows. Preallocate `k` and `v` for a maximum length and
#   write into them instead (keep `cache.k` the cached tokens only: a property returning
#   a slice). Why does a server not simply preallocate the maximum length for every
#   request? (Notebook 02 and lab 1.)
# * Replace steps 2-4 with `torch.nn.functional.scaled_dot_product_attention(...,
#   is_causal=True, enable_gqa=True)` (heads first: transpose to `(heads, n, head_dim)`)
#   and run the grader: which checks fail, and why? Read how `kvlab/model/attention.py`
#   calls it.
