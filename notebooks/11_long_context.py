# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 11 · Long context on a budget: windows, sinks and eviction
#
# *Engine files shown here:* `kvlab/cache/retention/` (`base.py`, `full.py`, `window.py`,
# `sinks.py`, `h2o.py`, `scores.py`), `kvlab/cache/paged.py` (`retain`),
# `kvlab/model/retained_metadata.py`, `kvlab/experiments/longctx.py`,
# `kvlab/viz/retention.py`.
#
# A sequence's KV grows by one token's keys and values in every layer per token. A
# *retention policy* caps it: after every step the paged cache asks the policy which of
# the sequence's blocks to keep, and gives the others back to the free list.
#
# - **window**: only the blocks of the last `retention_window` tokens;
# - **sinks** (StreamingLLM): the first `retention_sinks` tokens too, which models use as
#   an attention "sink";
# - **h2o** (heavy hitters): the recent window plus the older blocks that received the
#   most attention so far, scored on the torch reference path.
#
# This notebook shows the block table as the window slides, what happens to positions
# and to prefix sharing, the memory held against context length, and what each policy
# costs in perplexity and in recall of a fact hidden in a long prompt, on the real model.
#
# Set-up: one cell picks the device (CUDA if present, else CPU), seeds torch and loads
# the model. `FULL_SIZE = True` runs a bigger needle set and longer text (many minutes
# on a CPU; `benchmarks/long_context.py` prints the same figures from the command line).

# %%
import plotly.io as pio
import torch

import kvlab
from kvlab.cache.retention import DROPPED, RETENTION
from kvlab.config import EngineConfig, SamplingParams
from kvlab.experiments import longctx, quality
from kvlab.model.metadata import build_retained_metadata
from kvlab.units import MiB
from kvlab.viz.retention import block_map_figure, memory_figure, recall_frontier_figure

pio.renderers.default = "plotly_mimetype"
torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
model = kvlab.load_model(device=device, progress=False)
FULL_SIZE = False  # True: haystacks of 1k-4k tokens, 3 depths, 4k tokens of text
NEEDLE_LENGTHS = [1000, 2000, 4000] if FULL_SIZE else [160]
NEEDLE_DEPTHS = [0.1, 0.5, 0.9] if FULL_SIZE else [0.25, 0.75]
PPL_TOKENS, PPL_BUDGET = (4096, 256) if FULL_SIZE else (384, 96)
FRACTIONS = (0.1, 0.25, 0.5) if FULL_SIZE else (0.5,)  # budgets: shares of the KV
MAP_TOKENS, MAP_NEW = (200, 48) if FULL_SIZE else (160, 32)  # the block map's request
CHUNK = 64  # prefill chunk: a policy acts between chunks
print(model.name, "on", device)

# %% [markdown]
# ## What a long context costs
#
# One token's K and V in all 30 layers, and a full 8k-token context of this model:

# %%
engine = kvlab.Engine(model, EngineConfig(cache="paged"))
per_token = engine.cache.pool.bytes_per_token
print(f"{per_token:,} bytes per token; 8,192 tokens: {8192 * per_token / MiB:.0f} MiB")
print("retention policies:", RETENTION.names())

# %% [markdown]
# ## The block map as the window slides
#
# 160 tokens of held-out prose, prefilled in chunks of 32, then 32 greedy tokens, with
# sinks = 16 tokens (one block) and a window of 64. Each row is the sequence's block
# table after a step: blue blocks are kept (the number is the physical block), orange
# ones were dropped and went back to the free list. The table keeps its length: position
# `p` still lives in logical block `p // 16`.

# %%
text = quality.heldout_ids(model, MAP_TOKENS)
sliding = EngineConfig(cache="paged", retention="sinks", retention_sinks=16,
                       retention_window=64, chunked_prefill=True, max_num_batched_tokens=32,
                       kv_budget_tokens=512)  # fmt: skip
trace = longctx.table_trace(model, text, sliding, max_new_tokens=MAP_NEW)
last = trace[trace["step"] == trace["step"].max()]
print("last table:", [b if b != DROPPED else "x" for b in last["physical"]])
block_map_figure(trace)

# %% [markdown]
# Without sinks (`retention="window"`) block 0 goes as well:

# %%
window_only = EngineConfig(**{**sliding.__dict__, "retention": "window"})
trace = longctx.table_trace(model, text, window_only, max_new_tokens=MAP_NEW)
last = trace[trace["step"] == trace["step"].max()]
print("last table:", [b if b != DROPPED else "x" for b in last["physical"]])

# %% [markdown]
# ## Positions stay the original ones
#
# K is stored already rotated by RoPE at its token's position, so a dropped token leaves
# nothing to renumber: kept tokens keep their positions and a new query uses its absolute
# position. (StreamingLLM renumbers positions inside its cache; kvlab keeps the original
# ones.) The metadata of one decode step for a table whose blocks 0 and 2 were dropped
# (block size 4, the new token at position 15):

# %%
meta = build_retained_metadata([15], [1], [[DROPPED, 5, DROPPED, 7]], 4, torch.device("cpu"))
print("query position:", meta.positions.tolist())
print("slots it attends to:", meta.context_slots.tolist())

# %% [markdown]
# `tests/test_retention.py` checks the whole mechanism against transformers itself: the
# logits teacher-forced through the retaining cache equal one HF forward whose 4D
# attention mask shows each query exactly what was kept when it ran, at positions 0..n-1.
#
# ## Eviction and prefix sharing
#
# A dropped block that no other sequence holds leaves the prefix index: a later request
# with the same prompt can only hit the blocks before the first dropped one. With sinks,
# that is the sink block:

# %%
shared = EngineConfig(**{**sliding.__dict__, "prefix_caching": "hash"})
engine = kvlab.Engine(model, shared)
params = SamplingParams(max_new_tokens=4)
engine.generate([text], params)
[again] = engine.generate([text], params)
print("second request:", again.metrics.prefix_hit_tokens, "of", len(text), "tokens hit")
engine.cache.check_integrity()  # includes: no free block is in the prefix index

# %% [markdown]
# ## Memory held vs context length, and perplexity
#
# The held-out essay teacher-forced through a paged cache with each policy at the same
# budget, in chunks of 64 (the policy drops blocks between chunks, so later chunks see
# only what it kept). Full retention grows linearly; every other policy is flat.

# %%
ids = quality.heldout_ids(model, PPL_TOKENS)
base = EngineConfig(cache="paged", chunked_prefill=True, max_num_batched_tokens=CHUNK)
configs = {"full": base} | {p: longctx.budget_config(base, p, PPL_BUDGET) for p in longctx.POLICIES}
table, memory = longctx.perplexity_table(engine.runner, ids, configs, chunk=CHUNK)
table["final_kv_mib"] = table["final_kv_bytes"] / MiB
print(f"{len(ids)} tokens, budget {PPL_BUDGET} tokens")
print(table[["policy", "ppl", "ppl_vs_full_pct", "final_kv_mib"]].round(2).to_string(index=False))
memory_figure(memory)

# %% [markdown]
# The text is several times the budget long. Compare each policy's perplexity with full
# KV in the table: sinks + window should stay close to it at a fraction of the memory,
# while the window alone, once the first tokens are gone, does visibly worse: the model
# loses the tokens it parks attention on. h2o keeps the older blocks that drew the most
# attention, whichever they are.
#
# ## Needle in a haystack: the model's own recall first
#
# A fact ("The magic number of Corran is 4721.") placed at several depths of a haystack
# made of kvlab's documents, then a question. Before any eviction: how well does this
# 135M model recall it with its full KV? That is the ceiling every policy is measured
# against.

# %%
needles = longctx.needle_set(model.tokenizer, NEEDLE_LENGTHS, NEEDLE_DEPTHS)
longest = max(NEEDLE_LENGTHS) + 128
base = EngineConfig(cache="paged", chunked_prefill=True, max_num_batched_tokens=CHUNK,
                    max_num_seqs=1, max_model_len=longest, kv_budget_tokens=longest)  # fmt: skip
baseline = longctx.recall(model, needles, base)
print(baseline[["context_tokens", "depth", "recalled", "answer"]].to_string(index=False))

# %% [markdown]
# ## Recall vs KV kept
#
# Every policy at 50 % of each haystack's KV (`FULL_SIZE`: 10 and 25 % too), on the same
# needles. The prompt streams in by chunks, so the question at the end only sees what the
# policy kept.

# %%
frontier = longctx.recall_frontier(model, needles, base, FRACTIONS, baseline=baseline)
summary = frontier.groupby(["policy", "budget"], sort=False).agg(
    recall=("recalled", "mean"), kv_kept=("kv_kept_frac", "mean")
)
print(summary.round(2).to_string())
recall_frontier_figure(frontier)

# %% [markdown]
# Read the table against the baseline: a window keeps a needle only while it sits inside
# the last `retention_window` tokens (a deep needle at a large budget); sinks keep the
# start, not the fact; h2o keeps the fact only if its block drew enough attention while
# it streamed past, scored by queries that had not seen the question yet. Eviction trades
# recall for memory: the memory is flat, and a dropped block is gone for good.
#
# ## What to try next
#
# - Set `FULL_SIZE = True` (or run `python benchmarks/long_context.py`) for 1k-4k-token
#   haystacks at three depths.
# - Change the sinks to 0 tokens and watch perplexity follow the plain window.
# - Give h2o more heavy-hitter blocks and less window (`retention_heavy`,
#   `retention_window`): when does it start keeping the needle?
# - Put the question *before* the haystack: what does a window keep then?
# - Read `kvlab/cache/retention/h2o.py` and write a SnapKV-style policy (score the prompt
#   blocks from the last rows of the prompt only) as one new registered file.
