# ---
# jupyter:
#   jupytext:
#     cell_metadata_filter: -all
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
# # 02 · Paged vs naive
#
# *Engine files shown here:* `kvlab/cache/paged.py` (block tables, admission),
# `kvlab/cache/allocator.py` (free list, ref counts), `kvlab/cache/naive.py`,
# `kvlab/model/metadata.py` (slot mapping), `kvlab/viz/paged.py`,
# `kvlab/experiments/fragmentation.py` (waste by kind, a first-fit contiguous allocator).
#
# Notebook 01 ended with the naive cache: every request reserves a buffer for the longest
# sequence it could ever reach (`max_model_len`), and most of that buffer is never written.
# This notebook serves **the same document-QA workload with the same KV budget** through
# two caches, on the real model:
#
# * `cache="naive"`: one contiguous region of `max_model_len` token slots per sequence;
# * `cache="paged"`: the pool cut into blocks of 16 slots, handed out one at a time as a
#   sequence's tokens are written, and found through a per-sequence **block table**
#   (the idea of vLLM's PagedAttention: Kwon et al., SOSP 2023,
#   [arXiv:2309.06180](https://arxiv.org/abs/2309.06180)).
#
# and measures, step by step, how many sequences each keeps running, how much memory each
# reserves, and how much of that is waste, by kind (reservation, internal and external
# fragmentation); then, under a budget answers outgrow, what each admission policy buys.
# Then two widgets: a map of the physical blocks over time, and a block-size dial that
# re-runs the engine live.
#
# *Lesson plan (50 min):* sections 1-5 and the four "check yourself" cells; section 6's
# block-size dial, or the lab (`labs/01_block_allocator`), as homework.
#
# Set-up: one cell picks the device (CUDA if present, else CPU), seeds torch and loads
# the model.

# %%
import os
import platform
import time

import plotly.graph_objects as go
import plotly.io as pio
import torch
from IPython.display import display

import kvlab
from kvlab import workloads
from kvlab.cache.allocator import BlockAllocator
from kvlab.cache.paged import PagedCache
from kvlab.course import ask, show_source
from kvlab.experiments.fragmentation import (
    ContiguousAllocator,
    replay_stream,
    stream_from,
    trace_waste,
    waste_by_request,
)
from kvlab.model.metadata import build_attention_metadata
from kvlab.viz.fragmentation import refusal_strip
from kvlab.viz.paged import BlockMapExplorer, BlockSizeExplorer, memory_panels, occupancy_table

pio.renderers.default = "plotly_mimetype"
torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
model = kvlab.load_model(device=device, progress=False)

# %% [markdown]
# ## 1 · The workload
#
# `kvlab.workloads.doc_qa` builds document-QA requests: a shared ~300-token assistant
# preamble, one of 16 documents, then a question. Prompts are long (here ~460 to ~580
# tokens); answers are short. To keep this notebook to a minute or two on a laptop CPU
# (where prefill runs at a few hundred prompt tokens per second) we take 4 requests, a
# seed whose documents are among the shortest, and short answers only (8-16 tokens; by
# default 30 % of the answers are "long", 64-128 tokens). All arrive at once, and
# `ignore_eos=True` makes each produce exactly its `max_new_tokens`, so every count below
# is the same on every run.

# %%
requests = workloads.doc_qa(n=4, seed=2387, short_answer=(8, 16), long_fraction=0)
probe = kvlab.Engine(model, kvlab.EngineConfig(max_model_len=2048, kv_budget_tokens=2048))
prompt_tokens = [len(probe.encode(r.prompt)) for r in requests]
print("prompt tokens: ", prompt_tokens)
print("max_new_tokens:", [r.max_new_tokens for r in requests])

# %% [markdown]
# ## 2 · One budget, two caches
#
# Both engines get a KV budget of 2 × 2,048 = 4,096 token slots and `max_model_len=2048`
# (the longest prompt + answer must fit). The naive cache cuts the budget into 2 regions of
# 2,048 slots, so **at most 2 requests run at once**, however short they are. The paged
# cache cuts it into 4,096 / 16 = 256 blocks and gives a sequence a new block only when its
# last one is full.
#
# 2,048 is already kind to the naive cache. kvlab's default `max_model_len` is 8,192 (the
# model's context window), and at that length this budget does not hold even **one**
# naive sequence:

# %%
try:
    kvlab.Engine(model, kvlab.EngineConfig(cache="naive", kv_budget_tokens=2 * 2048))
except ValueError as error:
    print("ValueError:", error)

# %% [markdown]
# How the paged cache grows a sequence: before a step writes a sequence's new tokens, it
# appends blocks to the sequence's table until they fit (after copying a shared block it
# is about to write, notebook 03's copy-on-write). The blocks come from the
# `BlockAllocator`: a free list, oldest-freed first, and a reference count per block; a
# block whose count drops to zero goes to the back of the free list (or, with prefix
# caching, stays cached: notebook 03).

# %%
show_source(PagedCache.ensure_capacity)

# %%
display(show_source(BlockAllocator.allocate), show_source(BlockAllocator.decref))

# %% [markdown]
# **Check yourself.** All four prompts arrive at once, and the paged engine prefills them
# together in its first step. Right after that step, how many token slots does the paged
# cache hold (blocks taken × 16)? Compute it from `prompt_tokens` in one line of Python.
# (The naive engine, for comparison, holds 2 × 2,048 slots and has admitted only two.)

# %%
my_slots = None  # your answer: a line of Python using prompt_tokens and 16
ask("02.paged-slots", my_slots, prompt_tokens=prompt_tokens, block_size=16)

# %% [markdown]
# Now the real runs. `record_block_map=True` keeps, for every step, which request owns each
# physical block (for the block map in section 5). `trace_waste` serves the workload as
# `engine.run` does and also reads, after every step, each running sequence's written
# tokens and held slots from the cache (for the kinds of waste in section 4).

# %%
engines, outputs, traces, seconds = {}, {}, {}, {}
for name in ("naive", "paged"):
    config = kvlab.EngineConfig(
        cache=name,
        block_size=16,
        max_model_len=2048,
        kv_budget_tokens=2 * 2048,
        record_block_map=True,
    )
    engines[name] = kvlab.Engine(model, config)
    wall, cpu = time.perf_counter(), time.process_time()
    outputs[name], traces[name] = trace_waste(engines[name], requests, ignore_eos=True)
    seconds[name] = (time.perf_counter() - wall, time.process_time() - cpu)
    engines[name].cache.check_integrity()
stats = {name: engine.stats() for name, engine in engines.items()}
for name, engine in engines.items():
    held = stats[name]["reserved_bytes"].iloc[0] // engine.cache.pool.bytes_per_token
    print(f"{name}: {held:,} token slots held after step 1")

# %% [markdown]
# The cache only decides *where* K/V live, never *what* the model computes, so the greedy
# tokens must be identical:

# %%
same = [a.token_ids == b.token_ids for a, b in zip(outputs["naive"], outputs["paged"])]
print("identical greedy outputs:", all(same))
print("answer to request 0:", repr(outputs["paged"][0].text))

# %% [markdown]
# ## 3 · Memory and concurrency over time
#
# Top: reserved (solid) and live (dotted, slots that hold a token's K/V) memory. Middle:
# the waste, reserved minus live, as a share of reserved. Bottom: sequences running. The
# x axis is the engine step (one batched forward each).
#
# The naive cache reserves 2,048 slots the moment it admits a request, so its reserved
# line jumps to the budget while its live line stays far below. The paged cache's two
# lines lie on top of each other: it reserves what it writes, so more requests fit into
# the same budget, and with more of them in every decode step it needs fewer steps.

# %%
# NBVAL_IGNORE_OUTPUT
memory_panels(stats, x="step").show()

# %% [markdown]
# ## 4 · The numbers
#
# Steps, peak running sequences, waste (mean and peak over the steps that hold memory),
# blocks (the naive cache's "blocks" are its 2,048-slot regions) and preemptions:

# %%
print(occupancy_table(stats).to_string())

# %% [markdown]
# Why paging wins, in two lines. A sequence holding *n* tokens of KV leaves unwritten
#
# * naive: `max_model_len − n` slots, nearly all of its region while its prompt is short
#   next to the worst case;
# * paged: `ceil(n / block_size) × block_size − n` slots, **at most `block_size − 1`**:
#   only the tail of its last block.
#
# The bound holds at every step of the run:

# %%
paged, cache = stats["paged"], engines["paged"].cache
bound = paged["running"] * (cache.block_size - 1) * cache.pool.bytes_per_token
print("waste <= block_size - 1 slots per sequence:", bool((paged["waste_bytes"] <= bound).all()))
print(
    "most slots ever wasted at once:", int(paged["waste_bytes"].max() // cache.pool.bytes_per_token)
)

# %% [markdown]
# ### Three kinds of waste, named
#
# The PagedAttention paper ([Kwon et al., §3.1](https://arxiv.org/abs/2309.06180)) finds
# three sources of waste in systems that give each request one contiguous chunk sized for
# its maximum length: *reserved* slots for future tokens, *internal fragmentation* (slots
# over-provisioned for a length the request never reaches) and *external fragmentation*
# (from the memory allocator, "like the buddy allocator"). Blocks, it says (§1), alleviate internal
# fragmentation "by using relatively small blocks and allocating them on demand" and
# eliminate external fragmentation "as all blocks have the same size". In kvlab's terms:
#
# * **reservation** (naive): the slots of a sequence's `max_model_len` region beyond what
#   it has written, the paper's reserved slots (written later) and its internal
#   fragmentation (never written) together;
# * **internal fragmentation** (paged): the unwritten tail of a sequence's last block, at
#   most `block_size − 1` slots (the operating-system sense of the word: space inside an
#   allocated unit that its owner does not use);
# * **external fragmentation**: free memory that a request cannot use because it lies in
#   holes smaller than the request. Neither cache above has any: the naive regions are all
#   the same size, and the paged cache can use any free block.
#
# The runs measured the first two for every sequence after every step. Per request: tokens
# written after its first step and after the last step it was still running at, and the
# slots it held unwritten after its first step and at most:

# %%
by_request = {name: waste_by_request(trace) for name, trace in traces.items()}
for name, table in by_request.items():
    print(f"{name} ({table['kind'].iloc[0]}):")
    print(table.drop(columns="kind").to_string(), end="\n\n")
first_step = by_request["naive"]["unwritten first"]
print(f"naive: {first_step.min():,} to {first_step.max():,} slots unwritten after admission")
print(f"paged: at most {by_request['paged']['unwritten max'].max()} slots unwritten in a tail")

# %% [markdown]
# A naive region holds 1,472<!-- out --> to 1,591<!-- out --> slots its sequence has not
# written the moment it is admitted, and answers of 8 to 16 tokens fill almost none of
# them. A paged sequence never held more than 15<!-- out --> unwritten slots (its tail),
# whatever its length.
#
# External fragmentation needs regions of different sizes. Take a **contiguous** allocator
# kinder than the naive cache: it gives each request one region sized to its need (prompt
# + answer, rounded up to 16-slot blocks as the paged cache rounds; it knows each answer's
# length in advance, which a real server does not), placed by **first fit**, at the
# lowest-addressed hole that is large enough, and freed when the request finishes:

# %%
display(show_source(ContiguousAllocator.holes), show_source(ContiguousAllocator.allocate))

# %% [markdown]
# **Check yourself.** A contiguous first-fit allocator over 32 blocks holds regions
# `[0, 6)`, `[10, 18)` and `[20, 29)`: holes of 4, 2 and 3 blocks, 9 free. Requests D (3
# blocks), E (4) and F (2) come in that order, each placed or refused before the next. At
# what block does each start? Write `None` for a refusal.

# %%
my_starts = None  # your answer: three start blocks or None, e.g. [0, 6, None]
ask("02.first-fit", my_starts, capacity=32, regions=[(0, 6), (10, 8), (20, 9)], needs=[3, 4, 2])

# %% [markdown]
# Now a stream of arriving and finishing requests on the notebook's budget (256 blocks of
# 16 slots): 24 doc-QA requests with `doc_qa`'s default answers (8-24 tokens, 30 % of them
# 64-128), sized by the model's tokenizer, arriving as a Poisson process of 0.08 a step
# (`rate=0.08`, its seconds read as steps); each holds its blocks for `max_new_tokens`
# steps, one token a step as the engine decodes. No model runs: only the two allocators
# do. `replay_stream` sends the stream through the contiguous allocator and through kvlab's
# `BlockAllocator`, each first come first served, each taking a request's whole need when
# it admits it (as kvlab's `reserve` admission does): until the contiguous one first
# refuses a request that the free total could hold, both hold the same requests, so that
# refusal is contiguity's fault alone.

# %%
arriving = workloads.doc_qa(n=24, seed=0, rate=0.08)
stream = stream_from(arriving, [len(probe.encode(r.prompt)) for r in arriving], block_size=16)
replay = replay_stream(stream, num_blocks=256)
first = replay.first
print(f"step {first.step}: request {first.request} needs {first.need} blocks")
print(
    f"contiguous: {first.free_total} blocks free in holes of "
    f"{[size for _, size in first.holes]}, the largest {first.largest_hole}: refused"
)
print(f"paged, the same free blocks: admitted into blocks {first.paged_runs()} (first, last)")

# %% [markdown]
# The address range at that step. Top: what the request needs, laid over the largest hole:
# it runs past the hole's end into the next region. Middle: the contiguous layout, regions
# and holes. Bottom: the same blocks under the paged allocator, the request's blocks
# hatched, in both holes. Hover a bar for its blocks.

# %%
refusal_strip(first, block_size=16).show()

# %% [markdown]
# Over the whole stream: the steps each allocator needed, the steps in which the
# contiguous one refused its queue's head while enough blocks were free in total, and the
# request-steps spent waiting:

# %%
print(replay.summary().to_string())

# %% [markdown]
# The free memory was there; it was in the wrong shape. The contiguous allocator refused
# its queue's head in 103<!-- out --> steps while enough blocks were free in total, and
# everyone behind a refused head waited too: 973<!-- out --> request-steps of waiting
# against the paged allocator's 673<!-- out -->. Moving regions together
# (compaction) would merge the holes at the cost of copying their K/V; the paper (§3.1)
# finds compaction "impractical" in "a performance-sensitive LLM serving system" "due to the
# massive KV cache". Paging removes the need: a request's blocks need not be neighbours, so
# every free block counts.

# %% [markdown]
# ### What admission buys
#
# Above, the paged cache's admission never had to choose: all 4 requests and their answers
# fitted in its 256 blocks. When the answers outgrow the pool, the
# paged cache must decide whom to let in, `EngineConfig.admission`:
#
# * `"watermark"`, the paged default: a request is admitted when the blocks of its first
#   step (its prompt, or its first chunk with chunked prefill, less any blocks found in
#   the prefix cache) are free **and** a *watermark* of the pool, `EngineConfig.watermark`
#   (a fraction of the blocks), stays free for the running requests to grow into. The
#   watermark is waived when nothing runs, and kvlab's default is **0**: with it, a
#   request is admitted as soon as its first step's blocks are free. Blocks for its
#   answer are taken as it decodes; when they run out, the scheduler **preempts** a
#   running request (drops its blocks, recomputes it later);
# * `"reserve"`: a request is admitted only if the blocks it *could* ever need
#   (prompt + `max_new_tokens`) fit beside what the running requests could still claim:
#   nothing is ever preempted, but fewer run at once.
#
# vLLM V1 admits optimistically too: its scheduler admits a waiting request when
# `KVCacheManager.allocate_slots` finds free blocks for the tokens it schedules this step
# ([vllm/v1/core/kv_cache_manager.py](https://github.com/vllm-project/vllm/blob/main/vllm/v1/core/kv_cache_manager.py),
# called from
# [vllm/v1/core/sched/scheduler.py](https://github.com/vllm-project/vllm/blob/main/vllm/v1/core/sched/scheduler.py);
# recent releases also check, by default, that the whole prompt would fit, which matters
# only with chunked prefill). Its
# [`--watermark`](https://docs.vllm.ai/en/stable/configuration/engine_args/#-watermark)
# is applied as kvlab's is (to waiting or preempted requests, only while others are
# scheduled) and defaults to 0.0, which disables it; earlier V1 releases had no
# watermark at all, and
# [V0's block manager](https://github.com/vllm-project/vllm/blob/v0.2.7/vllm/core/block_manager.py)
# kept 1% of the blocks free.
#
# Three chat requests (37-, 38- and 44-token prompts, 8-token answers) in 16 blocks of 8
# slots: their prompts fill the pool exactly (5 + 5 + 6 blocks), and their answers need
# three blocks more.
#
# **Check yourself.** With `watermark=0.25` (a quarter of the 16 blocks kept free while
# others run), how many of the three requests does the engine admit in its first step?
# They are considered in order, each after the blocks of those before it are taken.

# %%
my_admitted = None  # your answer: 0, 1, 2 or 3
ask("02.watermark-admits", my_admitted, prompt_tokens=[37, 38, 44], num_blocks=16,
    block_size=8, watermark=0.25)  # fmt: skip

# %% [markdown]
# The runs, with the default watermark (0), with 0.25, and with `reserve`:

# %%
pressure, tokens = {}, {}
policies = {"watermark": {}, "watermark=0.25": {"watermark": 0.25}, "reserve": {}}
for name, extra in policies.items():
    config = kvlab.EngineConfig(
        cache="paged",
        admission=name.split("=")[0],
        block_size=8,
        max_model_len=128,
        kv_budget_tokens=16 * 8,
        **extra,
    )
    engine = kvlab.Engine(model, config)
    answers = engine.run(workloads.uniform_chat(3, max_new_tokens=8), ignore_eos=True)
    pressure[name], tokens[name] = engine.stats(), [a.token_ids for a in answers]
table = occupancy_table(pressure)
table["admitted in step 1"] = [int(p["running"].iloc[0]) for p in pressure.values()]
table["recomputed tokens"] = [int(p["recomputed_tokens"].iloc[-1]) for p in pressure.values()]
columns = ["admitted in step 1", "steps", "peak running", "peak blocks used", "preemptions"]
print(table[columns + ["recomputed tokens"]].to_string())
print(
    "identical greedy outputs:",
    tokens["watermark"] == tokens["watermark=0.25"] == tokens["reserve"],
)

# %% [markdown]
# `watermark` (at 0) starts more requests at once and fills the pool; when their answers
# outgrow it, it preempts and recomputes what it dropped (the recomputed tokens). A
# watermark of 0.25 keeps 4 blocks free for the running requests to grow into: it admits
# fewer at first and, here, avoids the preemption. `reserve` never preempts and never
# wastes a forward, but keeps blocks idle for answers not yet written, so fewer run at
# once and it needs more steps. Here every answer runs to its
# `max_new_tokens` (`ignore_eos`), the worst case `reserve` plans for; real answers that
# stop early at EOS leave its promises even emptier. That is why vLLM, and kvlab's paged
# default, admit optimistically. Notebook 05 looks at preemption under pressure.
#
# Time on this machine (not compared by the tests; the CPU time is steadier than the wall
# time on a shared machine). Don't expect a big speed-up here: these long prompts make
# prefill most of the work, it is compute-bound on a CPU, and it costs the same whichever
# cache stores the result. What paging buys is room: more sequences per step for the same
# memory. A decode step mostly reads the weights, so on a GPU, where it costs about the
# same for 2 sequences as for 4, that room turns into throughput.

# %%
# NBVAL_IGNORE_OUTPUT
for cache, (wall, cpu) in seconds.items():
    print(f"{cache:6} wall {wall:6.1f} s   CPU {cpu:6.1f} s")

# %% [markdown]
# ## 5 · The block map
#
# Each cell below is one physical block of 16 token slots (256 blocks, 32 per row),
# coloured by the request that owns it and labelled with its number; grey cells are free.
# **Move the slider** through the engine's steps: the first prefill hands out long runs of
# blocks in order; once requests finish, their blocks return to the free list and the next
# request's blocks come from wherever they were freed: a `*` after the number marks a block
# another request held at an earlier step (the title counts them). A request's blocks
# need not be contiguous: its block table lists them in logical order, and attention reads
# K/V through it. The slider starts at the step that used the most blocks.
#
# How attention finds a token's K/V: position *p* of a sequence lives in slot
# `table[p // block_size] * block_size + p % block_size`. kvlab builds these slots for
# every sequence of a step at once, from the block tables, before the forward runs:

# %%
show_source(build_attention_metadata, "pos = torch.arange(s_max)", "context_slots = tables.gather")

# %% [markdown]
# **Check yourself: fill in a block table.** A small paged engine: 8 blocks of 4 slots,
# all free. Request A (a 6-token prompt, one token to generate) and request B (9 tokens)
# are admitted in step 1: A gets blocks `[0, 1]`, B `[2, 3, 4]`. A finishes at the end of
# step 1, and its blocks go back to the free list, its last block first. Then request C
# arrives with a 14-token prompt. What is C's block table after its prefill? (Read
# `BlockAllocator.allocate` and `decref` above.)

# %%
my_table = None  # your answer: a list of block ids, e.g. [0, 1, 2, 3]
ask("02.block-table", my_table, num_blocks=8, block_size=4, prompt_lens=[6, 9, 14])

# %% [markdown]
# The same three requests in a real engine (their prompts are token ids, no chat
# template):

# %%
small = kvlab.Engine(
    model, kvlab.EngineConfig(cache="paged", block_size=4, max_model_len=32, kv_budget_tokens=32)
)
ids = model.tokenizer.encode(requests[0].prompt)
a = small.add_request(ids[:6], kvlab.SamplingParams(max_new_tokens=1), chat=False)
b = small.add_request(ids[:9], kvlab.SamplingParams(max_new_tokens=4, ignore_eos=True), chat=False)
small.step()  # A and B's prefill; A finishes
print(
    "after step 1: B", small.cache.tables[b], " free list", list(small.cache.allocator.free_blocks)
)
c = small.add_request(ids[:14], kvlab.SamplingParams(max_new_tokens=2, ignore_eos=True), chat=False)
small.step()  # C's prefill
print("after step 2: B", small.cache.tables[b], " C", small.cache.tables[c])

# %% [markdown]
# C's first blocks are ones never used; its last is one of A's, handed out again. In the
# doc-QA run above the same happens at scale: the block map below shows it.

# %%
# NBVAL_IGNORE_OUTPUT
blocks = BlockMapExplorer(engines["paged"])
blocks.widget()

# %% [markdown]
# The same map as a picture at that step (a widget does not show in a static copy of the
# notebook):

# %%
# NBVAL_IGNORE_OUTPUT
go.Figure(blocks.figure).show()

# %% [markdown]
# ## 6 · Choosing the block size
#
# Small blocks waste little (at most `block_size − 1` slots per sequence) but make block
# tables long: more entries to store, to build into the attention metadata every step,
# and to follow when attention gathers K/V. Large blocks make short tables but leave more
# of each sequence's last block empty; at the extreme, one block of `max_model_len` is the
# naive cache. vLLM's default is 16
# (`CacheConfig.DEFAULT_BLOCK_SIZE` in
# [vllm/config/cache.py](https://github.com/vllm-project/vllm/blob/main/vllm/config/cache.py)).
#
# **Pick a block size** in the widget: it serves a small chat workload (4 short prompts,
# 8-16 new tokens) through the paged engine, live, and adds a point for that size: tail
# waste (mean over steps, % of reserved) and block-table entries per running sequence.
# Each choice takes a few seconds on a CPU.

# %%
# NBVAL_IGNORE_OUTPUT
chat = workloads.chat(n=4, max_new_tokens=(8, 16))
sizes = BlockSizeExplorer(model, chat, budget_tokens=2048, block_size=16)
sizes.widget()

# %% [markdown]
# Setting the dropdown from code does what choosing in the widget does. Four more sizes,
# and the table of all measured so far:

# %%
for size in (1, 4, 64, 128):
    sizes.dropdown.value = size
print(sizes.table().to_string())

# %% [markdown]
# > **Summary.**
# > * The naive cache reserves `max_model_len` slots per sequence when it admits it; the
# >   paged cache hands out fixed-size blocks as tokens are written, found through a
# >   per-sequence **block table**, so a sequence wastes at most `block_size − 1` slots
# >   (the tail of its last block).
# > * Three kinds of waste: **reservation** (naive: a region beyond what is written),
# >   **internal fragmentation** (paged: the tail of the last block) and **external
# >   fragmentation** (a contiguous allocator refusing a request while enough is free in
# >   total, because no single hole is large enough; paging has none).
# > * Same budget, same tokens out: the paged cache ran 4<!-- out --> sequences at once
# >   where the naive one ran 2<!-- out -->, and needed fewer steps.
# > * The `BlockAllocator` keeps a free list (oldest-freed first) and a reference count
# >   per block; freed blocks are handed out again, wherever they sit.
# > * Admission: `watermark` (the default, watermark 0) admits a request as soon as its
# >   first step's blocks are free and preempts when decoding runs out of blocks, as vLLM
# >   does; `reserve` promises every request its worst case and never preempts.
# > * Block size trades tail waste (small blocks) against block-table length (large).

# %% [markdown]
# ## What to try next
#
# * Raise `max_model_len` to 4,096 (and the budget with it, to 2 × 4,096): the naive cache
#   still runs 2 requests, the paged one all 4.
# * Use `doc_qa()`'s default answers (drop `short_answer` and `long_fraction`): longer
#   answers widen the gap, because the naive region is reserved for the whole answer from
#   the first step.
# * Build a `BlockMapExplorer` on `engines["naive"]`: two huge "blocks", one per region.
# * Halve the budget (`kv_budget_tokens=2 * 1024`, `max_model_len=1024`: these prompts
#   fit): when do `watermark`'s preemptions start, and does `reserve` then finish sooner?
# * Many doc-QA prompts start with the same 300-token preamble, computed and stored once
#   per request here: that is what prefix caching shares.
#
# The stored timings and figures come from the machine below (a 2-core CPU unless it says
# otherwise); yours will differ in scale, not in shape. The printed block counts, waste
# shares and outputs are the same everywhere on CPU.

# %%
# NBVAL_IGNORE_OUTPUT
machine = platform.processor() or platform.machine()
print(f"{machine}, {os.cpu_count()} cores, torch on {torch.get_num_threads()} threads, {device}")
