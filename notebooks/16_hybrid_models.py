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
# # 16 · Hybrid models: one pool, many layer types
#
# *Engine files shown here:* `kvlab/cache/groups.py` (`kv_cache_groups`,
# `KVCacheGroup.blocks_needed`, `cross_group_hit`), `kvlab/cache/hybrid.py` (`GroupTables`:
# a group's block tables and what its window drops); measured by
# `kvlab/experiments/hybrid_cache.py` (`kv_held`, `chat_hits`) and `kvlab/multiturn.py`.
#
# Many recent models mix layer kinds. Gemma 2 alternates full-attention layers with
# sliding-window layers; Gemma 3 has five sliding-window layers (a window of 1,024 tokens)
# for every full one. A **full** layer reads every earlier token, so it needs the K/V of
# the whole context. A **sliding-window** layer of `W` tokens reads only the last `W`: the
# K/V of older tokens are dead weight for it. A paged cache that keeps every block for
# every layer (notebooks 02-03) stores that dead weight.
#
# vLLM's [hybrid KV cache manager](https://github.com/vllm-project/vllm/blob/main/docs/design/hybrid_kv_cache_manager.md)
# splits the layers into **KV cache groups** of one kind. Each group has its own block
# table per request over **one shared pool**, and a sliding group gives back the blocks
# its window has left. kvlab's `cache="hybrid"` does the same. This notebook shows how
# the groups are formed, their tables side by side as a window slides, the context one
# budget then holds, the rule for a prefix hit that every group can serve, and three
# traps of that rule, measured.
#
# SmolLM2-135M has 30 full-attention layers. Here it runs with Gemma 3's pattern laid over
# them (`attention_pattern="window=32*5,full"`: five layers with a 32-token window, then
# one full layer). This is a **teaching setting**: the model was not trained with
# windows, and section 3 shows what that costs its perplexity. The cache mechanics are the
# ones a model trained that way would use.
#
# Set-up: one cell picks the device (CUDA if present, else CPU), seeds torch and loads
# the model. `benchmarks/hybrid_cache.py` runs sections 3 and 5 at full size (longer
# chats, more sessions and budgets) from the command line.

# %%
import json
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio
import torch
from IPython.display import display

import kvlab
from kvlab.cache.groups import KVCacheGroup, cross_group_hit, kv_cache_groups
from kvlab.cache.hybrid import GroupTables
from kvlab.cache.retention import DROPPED
from kvlab.config import EngineConfig, SamplingParams
from kvlab.course import ask, show_source
from kvlab.experiments import quality
from kvlab.experiments.hybrid_cache import chat_hits, kv_held
from kvlab.model.pattern import parse_pattern
from kvlab.multiturn import chat_sessions, first_turn_ids, run_sessions
from kvlab.viz.style import palette_color

pio.renderers.default = "plotly_mimetype"
pd.set_option("display.width", 200)
torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
model = kvlab.load_model(device=device, progress=False)
LAYERS = model.config.num_hidden_layers  # 30
WINDOW = 32
PATTERN = f"window={WINDOW}*5,full"  # Gemma 3's 5 sliding : 1 full, with a 32-token window
SESSIONS, TURNS, NEW_TOKENS = 4, 2, 8  # section 5's chats: 4 users, 2 turns, 8-token answers
DOC_CHARS = 1200  # the four shortest documents (563-1,169 characters)
RESULTS = Path("../benchmarks/results")  # saved runs (benchmarks/attention_pattern.py)
print(model.name, "on", device)


def hybrid(**options) -> EngineConfig:
    """The pattern in KV cache groups, with prefix caching."""
    return EngineConfig(cache="hybrid", attention_pattern=PATTERN, prefix_caching="hash",
                        **options)  # fmt: skip


def paged(**options) -> EngineConfig:
    """The same model (the same pattern, the same tokens) on the paged cache: every layer
    keeps every block, as if every layer were full."""
    return EngineConfig(cache="paged", attention_pattern=PATTERN, prefix_caching="hash",
                        **options)  # fmt: skip


# %% [markdown]
# ## 1 · KV cache groups
#
# The pool's block has one shape, so every group must hold the same number of layers.
# vLLM takes the fewest layers any kind has as the group size and cuts each kind into
# groups of that size, full ones first; a kind whose count it does not divide ends with a
# smaller group, whose missing layers are pool layers nobody uses:

# %%
show_source(kv_cache_groups)

# %% [markdown]
# SmolLM2's 30 layers under Gemma 3's pattern: 5 full layers and 25 sliding ones, so
# groups of 5. `blocks_needed` (section 4) is how many blocks before a prefix hit the
# group must still hold.

# %%
groups = kv_cache_groups(parse_pattern(PATTERN, LAYERS))
table = pd.DataFrame(
    {
        "kind": ["full" if g.window is None else f"window {g.window}" for g in groups],
        "layers": [", ".join(map(str, g.layers)) for g in groups],
        "blocks_needed (blocks of 16)": [g.blocks_needed(16) or "all" for g in groups],
    }
)
print(table.rename_axis("group").to_string())
engine = kvlab.Engine(model, hybrid(kv_budget_tokens=2048))
per_block = max(len(g.layers) for g in groups)
per_layer = engine.cache.pool.bytes_per_token // per_block
print(f"a pool block holds {per_block} layers: {engine.cache.pool.bytes_per_token:,} bytes per "
      f"token slot ({LAYERS * per_layer:,} for all {LAYERS} "
      f"layers); a budget of 2,048 tokens is {engine.cache.num_blocks} blocks of 16")  # fmt: skip

# %% [markdown]
# A budget counted in tokens of the whole model (all 30 layers) is six times as many
# blocks of 5 layers; each group takes its blocks from that one pool as it needs them.
#
# **Check yourself.** Gemma-style patterns vary. With `"window=32*3,full"` (three sliding
# layers, then one full) over SmolLM2's 30 layers, how many KV cache groups are there,
# and how many layers does one block of the pool hold? Count the layers of each kind
# first; then check with `kv_cache_groups(parse_pattern("window=32*3,full", 30))`.

# %%
my_groups = None  # your answer: [number of groups, layers per block], e.g. [2, 15]
ask("16.groups", my_groups, pattern="window=32*3,full", layers=LAYERS)

# %% [markdown]
# ## 2 · One pool, many tables
#
# One request: 256 tokens of held-out prose, prefilled in chunks of 64, then 16 greedy
# tokens. After every step an observer records each group's block table and the blocks
# each group references (`engine.cache.group_blocks()`).

# %%
PROMPT_TOKENS, CHUNK, NEW = 256, 64, 16
text = quality.heldout_ids(model, PROMPT_TOKENS)
engine = kvlab.Engine(model, hybrid(kv_budget_tokens=2048, chunked_prefill=True,
                                    max_num_batched_tokens=CHUNK))  # fmt: skip
steps = []


def record(finished, engine=engine) -> None:
    """While the request runs: the tokens computed, each group's blocks and tables."""
    for seq in engine.cache.sequences.values():
        steps.append({"tokens": seq.num_computed, "blocks": engine.cache.group_blocks(),
                      "tables": [list(t) for t in engine.cache.group_tables(seq)]})  # fmt: skip


engine.observers.subscribe("after_step", record)
engine.generate([text], SamplingParams(max_new_tokens=NEW, ignore_eos=True))
last = steps[-1]  # the last step before the request finished
print(f"{len(steps)} steps; after the last ({last['tokens']} tokens computed), blocks "
      f"referenced per group: {last['blocks']}")  # fmt: skip
print("group 0's table:", last["tables"][0])
print("group 1's table:", ["x" if b == DROPPED else b for b in last["tables"][1]])


# %% [markdown]
# The tables side by side (a plotting helper of this notebook: rows are groups, columns
# logical blocks; the number is the physical block, an orange `x` a block the window
# dropped, `DROPPED` in the table):


# %%
def tables_figure(tables: list[list[int]], title: str) -> go.Figure:
    """Each group's block table: blue kept (the physical block), orange dropped."""
    z = [[0 if b == DROPPED else 1 for b in t] for t in tables]
    text = [["x" if b == DROPPED else str(b) for b in t] for t in tables]
    names = [f"group {g}: {'full' if grp.window is None else f'window {grp.window}'}"
             for g, grp in enumerate(groups)]  # fmt: skip
    figure = go.Figure(go.Heatmap(
        z=z, text=text, texttemplate="%{text}", y=names, zmin=0, zmax=1,
        colorscale=[[0, "#fdae6b"], [1, "#2b8cbe"]], showscale=False, xgap=2, ygap=2,
        hovertemplate="%{y}, logical block %{x}: %{text}<extra></extra>",
    ))  # fmt: skip
    figure.update_layout(title=title, xaxis_title="logical block", yaxis_autorange="reversed",
                         height=330, margin=dict(l=150))  # fmt: skip
    return figure


tables_figure(last["tables"], f"Block tables after {last['tokens']} tokens (x: dropped)")

# %% [markdown]
# Every group's table has one entry per block of the sequence, so logical block `i` holds
# positions `16 i .. 16 i + 15` in every group. The full group keeps them all; each
# sliding group keeps only the blocks its 32-token window still reaches. All six draw
# their blocks from one allocator, so their physical numbers interleave.
#
# The blocks each group references, step by step:

# %%
figure = go.Figure()
for g, group in enumerate(groups):
    kind = "full" if group.window is None else f"window {group.window}"
    figure.add_scatter(x=[s["tokens"] for s in steps], y=[s["blocks"][g] for s in steps],
                       name=f"group {g} ({kind})", mode="lines+markers",
                       line_color=palette_color(g))  # fmt: skip
figure.update_layout(title="Blocks each KV cache group references after each step",
                     xaxis_title="tokens computed", yaxis_title="blocks referenced",
                     height=380)  # fmt: skip
figure.show()

# %% [markdown]
# The full group grows by a block every 16 tokens; the five sliding groups stay flat at
# the window's few blocks. The lines that give a window's blocks back run after every
# step: a sliding group's retention is the window policy of notebook 11
# (`retention_window = W - 1`, the keys a query at a new position still reads), and a
# dropped block goes back to the shared allocator **still cached** when it is in the
# group's prefix index: a later prompt may hit it. The `checkpoint` test is section 5's
# retention interval; without one it is always true.

# %%
display(show_source(GroupTables.__init__, start="window = group.window", end="super().__init__"))
show_source(GroupTables.retain)

# %% [markdown]
# ## 3 · What one budget holds
#
# `kv_held` gives each system the same KV bytes and 16 distinct prompts of 128 tokens at
# once (no prefix to share), and records the most requests running at once and the most
# context tokens they hold. The budget is 512 tokens of the whole model: four of the
# prompts when every layer keeps every block.

# %%
HELD_BUDGET = 512
held = kv_held(model, {"paged (every block kept)": paged(kv_budget_tokens=HELD_BUDGET),
                       "KV cache groups": hybrid(kv_budget_tokens=HELD_BUDGET)},
               prompt_tokens=128, requests=16, max_new_tokens=4)  # fmt: skip
print(held.to_string(index=False))
ratio = held["most_context_tokens"].iloc[1] / held["most_context_tokens"].iloc[0]
print(f"the same {held['kv_bytes'].iloc[0]:,} bytes: the groups held {ratio:.2f}x the context")
figure = go.Figure(go.Bar(
    x=held["system"], y=held["most_context_tokens"],
    marker_color=[palette_color(0), palette_color(1)],
    text=[f"{r} running" for r in held["most_running"]], textposition="outside",
))  # fmt: skip
figure.update_layout(title=f"Most context tokens held at once, same budget ({HELD_BUDGET} tokens)",
                     yaxis_title="context tokens held", height=380)  # fmt: skip
figure.show()

# %% [markdown]
# On the same bytes the groups ran **9**<!-- out --> of the prompts at once where the
# paged cache ran **4**<!-- out -->, and held **2.25x**<!-- out --> the context. Not six
# times as much: a prompt's first step computes all 128 of its tokens, so until that step
# ends every group holds every block of it, and admission must find room for that peak;
# only then do the windows drop theirs and let the next prompts in. A prefill in chunks,
# or long decodes, keep the groups nearer to the windows' few blocks. (The paged cache
# holds as much with the pattern as without it: it keeps every block.)
#
# What the pattern costs the model is another matter. SmolLM2 was trained with every
# layer full, and `benchmarks/attention_pattern.py` measured its perplexity on 2,048
# held-out tokens with the pattern laid over it (its saved run, machine and command
# below):

# %%
saved = json.loads((RESULTS / "attention_pattern.avx512.json").read_text())
ppl = {row["pattern"]: row["ppl"] for row in saved["patterns"]}
print(f"perplexity, every layer full: {ppl['full']:.2f}; {PATTERN}: {ppl[PATTERN]:.2f} "
      f"({ppl[PATTERN] / ppl['full']:.1f}x)")  # fmt: skip
print({key: saved["provenance"][key] for key in ("machine", "command")})

# %% [markdown]
# **25.80**<!-- out --> with every layer full, **246.69**<!-- out --> with the pattern:
# **9.6x**<!-- out --> as high. A 32-token window is far shorter than Gemma 3's 1,024, and
# this model never learned to work within one. In this notebook the pattern drives the
# cache; its answers are not ones to use. A model trained with its windows does not pay
# that price, and gets the memory saving above.
#
# ## 4 · The prefix hit every group can serve
#
# A prefix hit of `h` blocks skips computing the prompt's first `h * 16` tokens: the first
# token computed is at position `p = 16 h`, in every layer. Each group must then hand
# its layers the K/V those layers read:
#
# - a **full** group reads every earlier position: it must hold blocks `0 .. h - 1`;
# - a **sliding** group of `W` tokens reads positions `p - W + 1 .. p`, and `p` itself is
#   computed: it must hold the `W - 1` tokens before `p`, the last
#   `ceil((W - 1) / 16)` blocks of the hit (2 for `W = 32`). Older blocks may be gone.
#
# The hit starts at the most the prompt allows (its last token always runs). Each full
# group cuts it at its first missing block; each sliding group moves it left past any
# missing block among the ones it needs; this repeats until no group moves it (vLLM's
# `find_longest_cache_hit`: full attention scans from the left, sliding windows from the
# right):

# %%
display(show_source(KVCacheGroup.blocks_needed))
show_source(cross_group_hit)

# %% [markdown]
# A worked example, one full group and one window of 32 (blocks of 16). The full group
# holds blocks 0-9; the window group holds 0, 3, 4, 7 and 9 (it dropped the others, or
# the LRU evicted them); the prompt allows a hit of 10 blocks. The full group allows 10.
# The window needs blocks 8 and 9 for `h = 10`: 8 is missing, so `h` jumps to 8, which
# needs 6 and 7: 6 is missing, `h = 6` needs 4 and 5: 5 is missing, `h = 5` needs 3 and
# 4: held. The full group serves 5 too:

# %%
pair = [KVCacheGroup(None, (1,)), KVCacheGroup(WINDOW, (0,))]
held_blocks = [set(range(10)), {0, 3, 4, 7, 9}]
print("hit:", cross_group_hit(pair, lambda g, i: i in held_blocks[g], 10, 16), "blocks")

# %% [markdown]
# The engine asks the same of its groups' prefix indexes. Section 2's request has
# finished: the full group's blocks are cached, and so are the blocks each window dropped
# (a dropped block stays cached). The same prompt again, and what `engine.explain` says
# about its hit:

# %%
[again] = engine.generate([text], SamplingParams(max_new_tokens=1))
print(engine.explain(again.request_id))

# %% [markdown]
# **Check yourself.** Blocks of 16, a full group holding blocks 0-11, a window of 32
# tokens holding blocks 0, 1, 2, 5, 6, 8 and 10; the prompt allows a hit of at most 12
# blocks. How many blocks hit?

# %%
my_hit = None  # your answer: a number of blocks
ask("16.hit", my_hit, groups=pair,
    held={"full": list(range(12)), "window 32": [0, 1, 2, 5, 6, 8, 10]},
    num_blocks=12, block_size=16)  # fmt: skip

# %% [markdown]
# [Lab 11 · The cross-group prefix hit](labs/11_hybrid_hit.ipynb) has you write
# `cross_group_hit` yourself; its last check asks your function what the groups' prefix
# indexes can serve while kvlab's engine runs SmolLM2 with this pattern, blocks evicted
# from some groups between prompts, and compares it with the hits the engine served.
#
# ## 5 · Three traps, measured
#
# The rule is exact, and it has consequences an operator meets as a hit rate that drops
# for no visible reason. Three of them, on multi-turn chats (`kvlab.multiturn`): four
# users each share one of the four shortest documents and ask about it, then come back
# with a second question whose prompt is the whole conversation so far. They are served
# in rounds, two turns at a time, so between one user's two turns come the other
# three's; `chat_hits` counts the prompt tokens the **second** turns hit. The users'
# first prompts, in tokens:

# %%
chats = chat_sessions(SESSIONS, TURNS, max_doc_chars=DOC_CHARS)
print([len(first_turn_ids(model.tokenizer, c.messages[0])) for c in chats])


def hits(configs: dict) -> pd.DataFrame:
    """chat_hits on this notebook's chats, rounded for printing."""
    frame = chat_hits(model, configs, [SESSIONS], TURNS, NEW_TOKENS, max_doc_chars=DOC_CHARS)
    return frame.drop(columns="sessions").round({"hit_pct": 1})


# %% [markdown]
# ### 5a · A hit is whole blocks
#
# A prefix hit counts whole blocks, and the prompt's last token always runs: a prompt
# no longer than one block never hits, however much of it is cached. vLLM gives every
# group's pages one size in bytes, and a model that mixes attention with Mamba or
# linear-attention layers, whose per-request state is large, gets attention blocks of
# thousands of tokens: vLLM [#53749](https://github.com/vllm-project/vllm/issues/53749)
# reports zero hits for any shared prefix shorter than one block on two such checkpoints,
# whose blocks were 2,096 and 1,920 tokens. The same chats with the groups at three block
# sizes, on a budget of 4,096 tokens that keeps every conversation:

# %%
grain = pd.concat(
    [hits({"KV cache groups": hybrid(kv_budget_tokens=4096, block_size=size)}).assign(
        block_size=size) for size in (16, 256, 1024)]
)  # fmt: skip
print(grain[["block_size", "later_turns", "hit_pct", "zero_hit_turns"]].to_string(index=False))
figure = go.Figure(go.Bar(x=grain["block_size"].astype(str), y=grain["hit_pct"],
                          marker_color=palette_color(1), text=grain["hit_pct"]))  # fmt: skip
figure.update_layout(title="Second turns' prompt tokens that hit, by block size",
                     xaxis_title="block size (tokens)", yaxis_title="hit (%)",
                     height=360)  # fmt: skip
figure.show()

# %% [markdown]
# In blocks of 16 the second turns hit **89.5**<!-- out -->% of their prompt tokens: all
# but the new question and the conversation's last, partial block. In blocks of 256,
# **46.2**<!-- out -->%: a turn hits at most its first 256 tokens, and the
# **2**<!-- out --> turns whose conversation so far was shorter than 256 tokens hit
# nothing, since a block is cached only once it is full. In blocks of 1,024, longer than
# every conversation here, nothing hits (**0.0**<!-- out -->%), on a budget that could
# keep them all.
#
# ### 5b · A window's blocks are the first evicted
#
# Now a budget too short to keep every conversation, and the same model on the paged
# cache (every layer keeps every block) beside the groups, on the same bytes: 384 tokens
# of the whole model, just over the longest prompt, and 768. Both run the pattern, so
# they give the same answers and only the cache differs.

# %%
BUDGETS = (384, 768)
chat = pd.concat(
    [hits({"paged (every block kept)": paged(kv_budget_tokens=budget),
           "KV cache groups": hybrid(kv_budget_tokens=budget),
           "groups, interval 64": hybrid(kv_budget_tokens=budget,
                                         prefix_cache_retention_interval=64)}).assign(
        budget=budget) for budget in BUDGETS]
)  # fmt: skip
print(chat[["budget", "system", "hit_pct", "zero_hit_turns", "window_cached_blocks"]].to_string(
    index=False))  # fmt: skip
figure = go.Figure()
for i, (system, rows) in enumerate(chat.groupby("system", sort=False)):
    figure.add_bar(x=[f"{b} tokens" for b in rows["budget"]], y=rows["hit_pct"], name=system,
                   marker_color=palette_color(i), text=rows["hit_pct"])  # fmt: skip
figure.update_layout(title="Second turns' prompt tokens that hit, by KV budget", barmode="group",
                     xaxis_title="KV budget (tokens of the whole model)", yaxis_title="hit (%)",
                     height=380)  # fmt: skip
figure.show()

# %% [markdown]
# At 768 tokens the groups keep the conversations (**89.5**<!-- out -->%) where the paged
# cache, on the same bytes, keeps little of them (**13.0**<!-- out -->%): a running turn's
# windows hold a few blocks each, which leaves more of the pool for cached blocks. At 384
# tokens neither keeps a conversation through three other users' turns, and there the
# groups fall *below* the paged cache: **2.9**<!-- out -->% against **5.8**<!-- out -->%,
# with **2**<!-- out --> of the 4 second turns hitting nothing. What the paged cache still
# hits at 384 is the one block every prompt shares, the first 16 tokens of the system
# message. Which group lost it? The groups' run at 384 again, with `engine.explain` on
# each second turn:

# %%
engine = kvlab.Engine(model, hybrid(kv_budget_tokens=BUDGETS[0]))
served = run_sessions(engine, chats, NEW_TOKENS, concurrency=2)
for turn in served:
    if turn.turn > 0:
        print(f"{turn.session_id}: {engine.explain(turn.request_id)}")

# %% [markdown]
# On the two turns that hit nothing, the full group and four of the five windows still
# hold the shared block; one window group lost it, and the hit every group can serve is
# zero. The LRU's order did it. The full group's table references the shared block for
# the whole turn, and when the turn ends the block is cached with the turn's other
# blocks. A window leaves block 0 in the turn's first step: it goes back to the LRU at
# once, older than anything the turn caches later, and when the pool runs short the LRU
# evicts the oldest first. One group's eviction is every group's miss, which is how vLLM
# [#48435](https://github.com/vllm-project/vllm/issues/48435) saw hybrid sliding-window
# hits collapse to zero, all or nothing, for every request of a multi-session round-robin
# on Gemma-4. Here the effect is small, one 16-token block on half of the turns, because
# a budget this short keeps little of any conversation in either cache; at 768 tokens the
# groups' smaller running footprint outweighs it.
#
# ### 5c · The retention interval
#
# Most of a window's dropped blocks are never read again: a hit at position `p` reads only
# the blocks just before `p`. The third system above sets
# `prefix_cache_retention_interval=64` (vLLM
# [#43447](https://github.com/vllm-project/vllm/pull/43447)): hits may land only at
# multiples of 64 tokens, so a dropped block stays cached only if a hit at the next
# multiple reads it, and the rest go straight to the free list. Which blocks a window
# keeps is `checkpoint`:

# %%
show_source(GroupTables.checkpoint)

# %% [markdown]
# **Check yourself.** A window of 32, blocks of 16, an interval of 64 tokens: of a sliding
# group's blocks 0-7, which stay cached once the window drops them?

# %%
my_kept = None  # your answer: a list of block numbers, e.g. [0, 1]
ask("16.interval-kept", my_kept, window=WINDOW, block_size=16, interval=64)

# %% [markdown]
# What the interval costs is where hits may land. A chat's next turn extends its whole
# conversation, so its hit ends at the conversation's last blocks, which the windows held
# until the turn finished and cached then, checkpoint or not: at 768 tokens the interval
# changed no hit (**89.5**<!-- out -->% with it and without) and left
# **173**<!-- out --> window blocks cached against **210**<!-- out -->. At 384 tokens it
# cost every second turn its hit (**4**<!-- out --> of 4 hit nothing): block 0 is no
# checkpoint (a hit of 64 tokens reads blocks 2 and 3), so no window kept the shared
# block. A prompt that shares only part of an earlier one pays every time. Two prompts
# that share their first 220 tokens, one after the other, prefilled in chunks of 64 so
# that the windows drop blocks as they go, with intervals of 64 and 128 tokens and
# without:

# %%
ids = quality.heldout_ids(model, 700)
first_prompt, second_prompt = ids[:220] + ids[400:464], ids[:220] + ids[600:640]
shared = next(i for i, (a, b) in enumerate(zip(first_prompt, second_prompt)) if a != b)
print(f"{len(first_prompt)} and {len(second_prompt)} tokens; they share the first {shared}: "
      f"{shared // 16} full blocks, {shared // 16 * 16} tokens")  # fmt: skip
rows = []
for interval in (None, 64, 128):
    engine = kvlab.Engine(model, hybrid(kv_budget_tokens=2048, chunked_prefill=True,
                                        max_num_batched_tokens=64,
                                        prefix_cache_retention_interval=interval))  # fmt: skip
    engine.generate([first_prompt], SamplingParams(max_new_tokens=1))
    window_index = next(p.index for p in engine.cache.parts if p.group.window is not None)
    cached = len(window_index.block_of)  # blocks in a window group's index, all cached now
    [out] = engine.generate([second_prompt], SamplingParams(max_new_tokens=1))
    rows.append({"interval": interval or "none", "window group's cached blocks": cached,
                 "second prompt's hit (tokens)": out.metrics.prefix_hit_tokens})  # fmt: skip
print(pd.DataFrame(rows).to_string(index=False))

# %% [markdown]
# The prompts share 13 full blocks, **208**<!-- out --> tokens. Without an interval a
# window group keeps all **17**<!-- out --> of the first prompt's blocks cached, and the
# second prompt hits all 208 tokens. With an interval it keeps **9**<!-- out --> (64) or
# **5**<!-- out --> (128), and the hit falls back to the last multiple of the interval
# before the prompts part: **192**<!-- out --> tokens, then **128**<!-- out -->. The
# interval is a dial between window blocks held for hits that may never come and hits
# that land up to an interval earlier.
#
# > **Summary.** A hybrid model's layers form KV cache groups of one kind and one size
# > (the fewest layers any kind has), each with its own block table over one shared pool
# > whose block holds one group's layers. A sliding group gives back the blocks its window
# > left, still cached, so the same budget holds more context. A prefix hit must be
# > served by every group: a full group needs every block of it, a window only its last
# > few. Hence three traps: a hit is whole blocks, so blocks longer than a prompt never
# > hit; one group that loses a block zeroes the hit of all, and a window's dropped
# > blocks are the LRU's oldest, evicted first; a retention interval keeps fewer window
# > blocks at the price of hits that land only on its multiples. On SmolLM2 the pattern
# > is a teaching setting: a model trained without windows loses much of its quality
# > under them.
#
# ## What to try next
#
# - `python benchmarks/hybrid_cache.py` runs sections 3 and 5 at full size (six users,
#   three turns, longer documents, budgets of 2,048-8,192 tokens).
# - Make the window 128 (`WINDOW = 128`): how many blocks must a sliding group keep, and
#   what happens to section 3's ratio?
# - Give section 3's systems a chunked prefill (`chunked_prefill=True,
#   max_num_batched_tokens=32`): does the groups' peak at admission shrink?
# - Try `"window=32*3,full"` (section 1's question): its last sliding group holds 2 of its
#   7 pool layers; what does that padding cost in blocks?
# - Write `cross_group_hit` yourself in
#   [Lab 11 · The cross-group prefix hit](labs/11_hybrid_hit.ipynb).
