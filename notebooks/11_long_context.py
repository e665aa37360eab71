# ---
# jupyter:
#   jupytext:
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
# # 11 · Long context on a budget: windows, sinks and eviction
#
# *Engine files shown here:* `kvlab/cache/retention/` (`base.py`, `full.py`, `window.py`,
# `sinks.py`, `h2o.py`, `scores.py`), `kvlab/cache/paged.py` (`retain`),
# `kvlab/model/metadata.py` (`build_retained_metadata`), `kvlab/experiments/longctx.py`,
# `kvlab/viz/retention.py`.
#
# A sequence's KV grows by one token's keys and values in every layer per token. A
# *retention policy* caps it: after every step the paged cache asks the policy which of
# the sequence's blocks to keep, and gives the others back to the free list.
#
# - **window**: only the blocks of the last `retention_window` tokens;
# - **sinks** (StreamingLLM): the first `retention_sinks` tokens too, which models use as
#   an attention "sink";
# - **h2o** (heavy hitters, [H2O](https://arxiv.org/abs/2306.14048)): the recent window
#   plus the older blocks that received the most attention so far, scored on the torch
#   reference path.
#
# This notebook shows the block table as the window slides and the lines that release
# its blocks, what happens to positions and to prefix sharing, the memory held against
# context length, and what each policy costs in perplexity and in recall of a fact hidden
# in a long prompt, on the real model.
#
# Set-up: one cell picks the device (CUDA if present, else CPU), seeds torch and loads
# the model. `FULL_SIZE = True` runs haystacks of 1k-4k tokens at three budgets and 4k
# tokens of text (many minutes on a CPU; `benchmarks/long_context.py` prints the same
# figures from the command line, and its saved run is read in the last section).

# %%
import json
from pathlib import Path

import pandas as pd
import plotly.io as pio
import torch
from IPython.display import display

import kvlab
from kvlab.cache.paged import PagedCache
from kvlab.cache.retention import DROPPED, RETENTION, RetentionPolicy
from kvlab.cache.retention.sinks import SinksRetention
from kvlab.config import EngineConfig, SamplingParams
from kvlab.course import ask, show_source
from kvlab.experiments import longctx, quality
from kvlab.model.metadata import build_retained_metadata
from kvlab.units import MiB
from kvlab.viz.retention import block_map_figure, memory_figure, recall_frontier_figure

pio.renderers.default = "plotly_mimetype"
torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
model = kvlab.load_model(device=device, progress=False)
FULL_SIZE = False  # True: haystacks of 1k-4k tokens, budgets of 10/25/50 %, 4k tokens of text
NEEDLE_LENGTHS = [1000, 2000, 4000] if FULL_SIZE else [512]
NEEDLE_DEPTHS = [0.1, 0.7, 0.9]  # where the fact sits in the haystack: early, late, last
PPL_TOKENS, PPL_BUDGET = (4096, 256) if FULL_SIZE else (384, 96)
FRACTIONS = (0.1, 0.25, 0.5) if FULL_SIZE else (0.5,)  # budgets: shares of the KV
ANSWER_TOKENS = 16  # enough for "The magic number of <city> is <n>."
MAP_TOKENS, MAP_NEW = 160, 32  # the block map's request: prompt tokens, then greedy ones
CHUNK = 64  # prefill chunk: a policy acts between chunks
RESULTS = Path("../benchmarks/results")  # saved runs of benchmarks/long_context.py
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
# sinks = 16 tokens (one block) and a window of 64, in blocks of 16:

# %%
text = quality.heldout_ids(model, MAP_TOKENS)
sliding = EngineConfig(cache="paged", retention="sinks", retention_sinks=16,
                       retention_window=64, chunked_prefill=True, max_num_batched_tokens=32,
                       kv_budget_tokens=512)  # fmt: skip
print(f"block_size={sliding.block_size}, sinks={sliding.retention_sinks}, "
      f"window={sliding.retention_window}")  # fmt: skip

# %% [markdown]
# **Check yourself.** Before you run the map: once the whole prompt is in (160 tokens
# computed), which logical blocks of the sequence's table are still kept? Write the list
# of logical block numbers (the table has 160 / 16 = 10 of them, 0-9), then find the row
# "160" in the map below to see the answer.

# %%
my_kept_blocks = None  # your answer: a list of logical block numbers, e.g. [0, 1, 2]
ask("11.sinks-kept", my_kept_blocks, config=sliding)

# %% [markdown]
# Each row of the map is the sequence's block table after a step (the y axis: tokens in
# the cache then). Blue blocks are kept (the number is the physical block), orange ones
# were dropped and went back to the free list. The table keeps its length: position `p`
# still lives in logical block `p // 16`.

# %%
trace = longctx.table_trace(model, text, sliding, max_new_tokens=MAP_NEW)
last = trace[trace["step"] == trace["step"].max()]
print("last table:", [b if b != DROPPED else "x" for b in last["physical"]])
block_map_figure(trace)

# %% [markdown]
# The lines that decide and release. A policy names the logical blocks to drop among the
# full, computed ones (`candidates`); the window starts at the block holding the
# `retention_window`-th last token (`recent_start`); the sinks policy spares the blocks
# before `self.sinks`. The cache then writes `DROPPED` into the table, takes the block out
# of the prefix index if no other sequence holds it, and gives it back to the allocator
# (`decref` returns true when its count reaches zero):

# %%
display(show_source(RetentionPolicy, start="def candidates", end="return max("))
display(show_source(SinksRetention.drop))
show_source(PagedCache.retain)

# %% [markdown]
# Without sinks (`retention="window"`) block 0 goes as well:

# %%
window_only = EngineConfig(**{**sliding.__dict__, "retention": "window"})
trace = longctx.table_trace(model, text, window_only, max_new_tokens=MAP_NEW)
last = trace[trace["step"] == trace["step"].max()]
print("last table:", [b if b != DROPPED else "x" for b in last["physical"]])

# %% [markdown]
# ## Positions: the text's, not the cache's
#
# StreamingLLM ([Xiao et al., 2023](https://arxiv.org/abs/2309.17453), section 3.2)
# numbers positions *inside its cache*: with the tokens at text positions
# [0, 1, 2, 3, 6, 7, 8] cached and token 9 being decoded, it assigns the positions
# [0, 1, ..., 7], not the text's [0, 1, 2, 3, 6, 7, 8, 9]. The reason is RoPE past the
# trained window. StreamingLLM's aim is a stream millions of tokens long; a RoPE model's
# attention depends on the distance between a query's position and a key's, and the
# model has never been trained on distances beyond its pre-training context: past it,
# the paper shows, perplexity blows up. Numbered inside the cache, no distance ever
# exceeds the cache size, however long the stream. For that it caches keys *before* the
# rotation and rotates them again at every decoding step.
#
# kvlab does not renumber. Its K is stored already rotated at its token's text position
# (as vLLM's is), so a dropped token leaves nothing to renumber: kept tokens keep their
# positions and a query uses its absolute position. The price is the one StreamingLLM
# avoids: a kvlab sequence still ends at `max_model_len` (at most the model's
# `max_position_embeddings`). kvlab's policies cap a long context's *memory*, not its
# length.
#
# **Check yourself.** In StreamingLLM's example above, which position does the new
# token's query get? (kvlab would give it 9.)

# %%
my_query_position = None  # your answer: a whole number
ask("11.streaming-position", my_query_position, kept=[0, 1, 2, 3, 6, 7, 8])

# %% [markdown]
# kvlab's metadata of one decode step for a table whose blocks 0 and 2 were dropped
# (block size 4, the new token at position 15): the query keeps position 15, and it
# attends to the slots of blocks 5 and 7 only.

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
# The text is four times the budget. Sinks + window stays close to full KV
# (+**5.23**<!-- out -->% perplexity) at under a third of its memory, while the window
# alone, once the first tokens are gone, nearly doubles it (+**97.58**<!-- out -->%): the
# model loses the tokens it parks attention on. h2o keeps the older blocks that drew the
# most attention, whichever they are (+**2.49**<!-- out -->% here).
#
# ## Needle in a haystack: the model's own recall first
#
# A fact ("The magic number of Corran is 4721.") placed at three depths (0.1, 0.7 and
# 0.9) of a 512-token haystack made of kvlab's documents, then a question. Before any
# eviction: how well does this 135M model recall it with its full KV? That is the
# ceiling every policy is measured against.

# %%
needles = longctx.needle_set(model.tokenizer, NEEDLE_LENGTHS, NEEDLE_DEPTHS)
longest = max(NEEDLE_LENGTHS) + 128
base = EngineConfig(cache="paged", chunked_prefill=True, max_num_batched_tokens=CHUNK,
                    max_num_seqs=1, max_model_len=longest, kv_budget_tokens=longest)  # fmt: skip
baseline = longctx.recall(model, needles, base, ANSWER_TOKENS)
print(baseline[["context_tokens", "depth", "prompt_tokens", "recalled", "answer"]].to_string(
    index=False))  # fmt: skip

# %% [markdown]
# ## Recall vs KV kept
#
# Every policy at 50 % of each haystack's KV (`FULL_SIZE`: 10 and 25 % too), on the same
# needles. The prompt streams in by chunks of 64, so the question at the end only sees
# what the policy kept. Which depths each policy still answers:

# %%
frontier = longctx.recall_frontier(model, needles, base, FRACTIONS, baseline=baseline,
                                   max_new_tokens=ANSWER_TOKENS)  # fmt: skip
shown = frontier.assign(budget=frontier["budget"].map("{:.0%}".format))
by_depth = shown.pivot_table(index=["policy", "budget"], columns="depth", values="recalled",
                             aggfunc="mean", sort=False)  # fmt: skip
summary = shown.groupby(["policy", "budget"], sort=False).agg(
    recall=("recalled", "mean"), kv_kept=("kv_kept_frac", "mean")
)
print(by_depth.map(lambda r: "recalled" if r == 1 else "-").to_string())
print(summary.round(2).to_string())
recall_frontier_figure(frontier)

# %% [markdown]
# With its full KV the model recalls every needle (recall **1.0**<!-- out -->). At half
# the KV, the window and the sinks keep the last half of the prompt: they answer the
# needles at depths 0.7 and 0.9 (recall **0.4**<!-- out -->) and lose the three before;
# the sinks' first block holds the haystack's opening, not the fact. h2o splits its
# budget into heavy hitters and a window half as long, and keeps only the deepest needle
# (**0.2**<!-- out -->): its heavy hitters were chosen by the attention of queries that
# had not seen the question yet, and they were other blocks than the fact's. A policy
# keeps a fact by its position (window, sinks) or by the attention it drew before the
# question came (h2o); none knows what will be asked.
#
# Five needles in one 512-token haystack is a small sample. The saved run of
# `benchmarks/long_context.py` asks the same question at the model's scale: 12 needles in
# haystacks of 1,000 to 8,000 tokens, at three budgets (its machine and command below):

# %%
saved = json.loads((RESULTS / "long_context.avx2.json").read_text())
recall_saved = pd.DataFrame(saved["recall"]).T
recall_saved.index = pd.MultiIndex.from_tuples(
    [tuple(k.split("@")) for k in recall_saved.index], names=["policy", "budget"]
)
print(saved["needles"], "| full KV recall by length:", saved["full_recall_by_length"])
print(recall_saved["recall"].unstack("budget").to_string())
print({key: saved["provenance"][key] for key in ("machine", "command")})

# %% [markdown]
# The saved run tells the same story at the model's scale, with what a small haystack
# cannot show. At 10 % of the KV no policy recalls more than **0.167**<!-- out --> of the
# needles. And the ceiling itself falls with length: with its full KV this 135M model
# recalls only a third of the 4,000-token needles, so past a few thousand tokens a
# policy's misses mix with the model's own. At 50 % h2o recalls the most there
# (**0.417**<!-- out -->), unlike in the small haystack above: with 12 needles there and
# 5 here, one needle moves these fractions by 0.08 and 0.2.
#
# Eviction trades recall for memory: the memory is flat, and a dropped block is gone for
# good.
#
# > **Summary.** A retention policy caps one sequence's KV by dropping whole blocks after
# > each step: the block table keeps its length, the dropped entries go back to the free
# > list and leave the prefix index. Sinks + window keeps perplexity close to full KV at
# > a flat memory cost; the window alone loses the first tokens and with them its
# > footing. kvlab keeps every token's text position (its K is stored rotated), so
# > eviction saves memory but does not stretch the model's window, which is why
# > StreamingLLM renumbers positions inside its cache instead. None of these policies
# > knows what the question will be: a fact outside the window survives only by luck
# > (h2o's attention scores), so recall falls with the budget.
#
# ## What to try next
#
# - Set `FULL_SIZE = True` (or run `python benchmarks/long_context.py`) for 1k-4k-token
#   haystacks at three budgets.
# - Change the sinks to 0 tokens and watch perplexity follow the plain window.
# - Give h2o more heavy-hitter blocks and less window (`retention_heavy`,
#   `retention_window`): when does it start keeping the needle?
# - Put the question *before* the haystack: what does a window keep then?
# - Read `kvlab/cache/retention/h2o.py` and write a
#   [SnapKV](https://arxiv.org/abs/2404.14469)-style policy (score the prompt
#   blocks from the last rows of the prompt only) as one new registered file.
