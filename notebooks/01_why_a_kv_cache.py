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
# # 01 · Why a KV cache
#
# *Engine files shown here:* `kvlab/engine/core.py` (the step loop), `kvlab/model/runner.py`
# (the forward that writes and reads K/V), `kvlab/cache/naive.py`,
# `kvlab/experiments/why_cache.py`.
#
# *Lesson plan (50 min):* sections 1-4 and their three "check yourself" cells; section 5's
# explorer is for the learner's own time.
#
# A language model writes one token at a time, and every new token attends to **all** the
# tokens before it. This notebook shows, on a real model (SmolLM2-135M-Instruct, running
# through kvlab's own forward pass), three things:
#
# 1. **Without a cache** each new token re-runs the model over the whole sequence so far;
#    **with a cache** it runs over just the new token and reads the earlier tokens' keys
#    and values (K/V) from memory. Same tokens out; without the cache the time per token
#    grows with the context, with it the time stays nearly flat.
# 2. **The cache costs memory**: a fixed number of bytes for every token of every sequence.
# 3. **Reserving that memory naively** (a worst-case buffer per user) wastes most of it,
#    which is the problem the paged cache of notebook 02 solves.
#
# Set-up: one cell picks the device (CUDA if present, else CPU), seeds torch and loads
# the model. `FULL_SIZE = True` decodes 32 tokens in section 2 instead of 20, adds a
# 768-token point to its context sweep and lets section 4's answers run to 32 tokens
# instead of 16 (longer on a CPU).

# %%
import platform

import plotly.graph_objects as go
import plotly.io as pio
import torch

import kvlab
from kvlab import texts
from kvlab.course import ask, show_source
from kvlab.engine.core import EngineCore
from kvlab.experiments.why_cache import (
    compare_decoding,
    decode_timings,
    latency_by_context,
    weight_bytes,
)
from kvlab.model.runner import ModelRunner

pio.renderers.default = "plotly_mimetype"
torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
model = kvlab.load_model(device=device, progress=False)
FULL_SIZE = False  # True: 32 new tokens and a 768-token point in section 2, answers of 32
NEW_TOKENS = 32 if FULL_SIZE else 20  # section 2
CONTEXTS = [64, 128, 256, 512, 768, 1024] if FULL_SIZE else [64, 128, 256, 512, 1024]
ANSWER_TOKENS = 32 if FULL_SIZE else 16  # section 4

# %% [markdown]
# ## 1 · Generating text with kvlab's engine
#
# `kvlab.Engine` serves requests: it tokenizes the prompt (with the model's chat
# template), runs one batched forward per step and samples. Greedy decoding
# (`temperature=0`, the default) is deterministic.

# %%
engine = kvlab.Engine(model, kvlab.EngineConfig(max_model_len=1024, kv_budget_tokens=4 * 1024))
[out] = engine.generate(["What is the capital of France?"], kvlab.SamplingParams(max_new_tokens=16))
print(out.text)
print("prompt token ids:   ", out.prompt_token_ids)
print("generated token ids:", out.token_ids, f"(finished by {out.finish_reason})")

# %% [markdown]
# ### The engine's step, and continuous batching
#
# `generate` queues the prompts and calls `engine.step()` until none is left. Every later
# notebook talks in steps, so here is one. A step is three calls:
#
# 1. the **scheduler** picks the batch: which requests run and how many tokens each, a
#    new request's whole prompt (its **prefill**) or one token for each request that is
#    already **decoding**;
# 2. the **runner** computes the whole batch in one forward pass;
# 3. **postprocess** samples each row's next token, appends it to its request, and
#    retires the requests that finished (end of sequence, or `max_new_tokens`).
#
# Because the batch is chosen afresh at every step, a request that finishes leaves at
# once and a waiting one takes its place at the next step, without waiting for the rest
# of the batch to finish: **continuous batching** (iteration-level scheduling, from
# [Orca, OSDI 2022](https://www.usenix.org/conference/osdi22/presentation/yu), as vLLM
# and SGLang do). Section 4 shows it in a live run; notebook 05 looks at the scheduler in
# depth. The step, from kvlab's source (the speculator and the failure handling are for
# later notebooks; `observers` let other code watch each step without changing it):

# %%
show_source(EngineCore.step)

# %% [markdown]
# ## 2 · Decoding without and with the cache
#
# Inside an attention layer, token *t* needs the keys and values of tokens 0…*t*. Those
# K/V vectors never change once computed, so there are two ways to get them:
#
# * **no cache**: recompute them, i.e. run the whole sequence through the model again for
#   every new token. At context *n* the linear layers (the Q/K/V and output projections,
#   the MLP) then do *O(n)* work for one new token, and attention, every one of the *n*
#   tokens against all the tokens before it, *O(n²)*;
# * **KV cache**: store each token's K/V the first time, and for every later token run the
#   model over just that one token: the linears do *O(1)* work, and its attention reads
#   the *n* cached K/V, *O(n)*.
#
# The two modes differ in one line: where the forward starts. Without the cache it starts
# at position 0 every time; with it, at the newest token (the first token comes from the
# prompt's prefill in both):

# %%
show_source(decode_timings, "for _ in range(new_tokens)", "tokens.append(token)")

# %% [markdown]
# Inside the forward, every layer **writes** the new tokens' K/V into the pool (the
# slots `meta.slot_mapping` names), then **attends** over the whole context read back
# from the pool, the cached tokens and the new ones alike. With the cache, the "whole
# context" is mostly tokens computed in earlier steps. (`attention_fn` reads the context
# back with `pool.gather(layer, slots)`; `forward` is wrapped in `torch.inference_mode()`,
# and `__wrapped__` is the function itself.)

# %%
show_source(ModelRunner.forward.__wrapped__, "for index in range", "attn = self.attention_fn")

# %% [markdown]
# `kvlab.experiments.why_cache.compare_decoding` decodes the same prompt (a paragraph of the
# held-out text) both ways and times every generated token.
#
# **Check yourself.** Before running it: *without* the cache, how many token positions
# does the model run through in total to generate `new_tokens` tokens after this
# `len(prompt_ids)`-token prompt (the first token comes from the prompt's prefill)? Write
# a line of Python that computes it from `len(prompt_ids)` and `new_tokens`.

# %%
paragraph = texts.heldout().split("\n\n")[9]  # "The great breakthrough was the pound lock..."
prompt_ids = model.tokenizer.encode(paragraph)
new_tokens = NEW_TOKENS
print(f"prompt: {len(prompt_ids)} tokens, new_tokens = {new_tokens}")

# %%
my_positions = None  # your answer: a line of Python using len(prompt_ids) and new_tokens
ask("01.positions-no-cache", my_positions, prompt_len=len(prompt_ids), new_tokens=new_tokens)

# %%
timings = compare_decoding(engine.runner, prompt_ids, new_tokens)
by_mode = {mode: rows["token"].tolist() for mode, rows in timings.groupby("mode")}
print("identical greedy tokens:", by_mode["no cache"] == by_mode["KV cache"])
print("continuation:", repr(model.tokenizer.decode(by_mode["KV cache"])))
# Each forward runs over the tokens from its start to the newest one (`position` of them
# without the cache; the prompt, then one per token, with it).
no_cache = timings[timings["mode"] == "no cache"]
print("token positions run without the cache:", int(no_cache["position"].sum()))
print("token positions run with the cache:   ", len(prompt_ids) + new_tokens - 1)

# %% [markdown]
# Same tokens, for a fraction of the work. Timed token by token, though, 20 tokens show
# little growth: the context grows by 19 tokens beyond the prompt's 113<!-- out -->, a
# change small enough to drown in the noise of a CPU shared with other work. To see the
# growth, time one generated token at contexts from 64 to 1,024 tokens: without the
# cache, a forward over all *n* tokens; with it, a forward over token *n* alone, reading
# the K/V of the *n − 1* tokens before it from a pool filled beforehand (untimed). Each
# point is the median of 3 runs.

# %%
text_ids = model.tokenizer.encode(texts.heldout())
sweep = latency_by_context(engine.runner, text_ids, CONTEXTS, repeats=3)
same = sweep.groupby("context")["token"].nunique().eq(1).all()
print("same next token with and without the cache at every context:", bool(same))

# %%
# NBVAL_IGNORE_OUTPUT
ms = sweep.pivot(index="context", columns="mode", values="latency_s")[["no cache", "KV cache"]]
ms = 1e3 * ms
ms["no cache / KV cache"] = ms["no cache"] / ms["KV cache"]
print("ms per generated token, by context length:")
print(ms.round(1).to_string())
fig = go.Figure(
    [
        go.Scatter(x=ms.index, y=ms[mode], name=mode, mode="lines+markers")
        for mode in ("no cache", "KV cache")
    ],
    layout=dict(
        title="Time per generated token vs context length",
        xaxis_title="context length (tokens before the new one)",
        yaxis_title="ms per token (median of 3)",
        height=380,
    ),
)
fig.show()

# %% [markdown]
# Without the cache the time per token grows with the context, close to linearly:
# doubling the context about doubles it. With the cache it rises only slowly: the
# linears run on one token whatever the context, and reading a longer context's cached
# K/V (attention's *O(n)*) adds little next to reading the model's weights. The gap is
# the cache's speed-up, and it widens with every token of context. (Timings vary from
# run to run on a shared machine; the shape does not.)
#
# Why close to *linear*, if attention is *O(n²)*? Count the arithmetic of one no-cache
# forward (a multiply-add is 2 FLOPs): the linears cost the same per token at any
# context, attention's cost per token grows with the context. For this model:

# %%
runner = engine.runner
weights = [w for lw in runner.layers for w in (lw.qkv, lw.o, lw.gate_up, lw.down)]
linear_per_token = sum(2 * w.numel() for w in weights)  # FLOPs of one token through them
width = runner.num_heads * runner.head_dim  # query heads x head size
for n in (64, 1024, 8192):
    linears = n * linear_per_token  # every token through every linear: O(n)
    # token i attends to i + 1 keys, QK^T and the weighted sum of V: O(n^2) in all
    attention = runner.kv_spec.num_layers * 4 * width * n * (n + 1) // 2
    share = attention / (linears + attention)
    print(
        f"n = {n:5}: linears {linears / 1e9:6.1f} GFLOP, attention {attention / 1e9:6.1f} "
        f"GFLOP ({share:.0%} of the forward)"
    )

# %% [markdown]
# Over the sweep the linears do most of the work: attention is 1%<!-- out --> of the
# forward at 64 tokens and 14%<!-- out --> at 1,024, so the time per token grows about
# linearly. At 8,192 tokens (the model's context window) attention is 57%<!-- out --> of
# it, and the quadratic term takes over. (The LM head runs on the newest token only, in
# both modes, so it is left out.) Over a whole generation of *N* tokens, the no-cache way
# does *O(N²)* linear work and *O(N³)* attention; the cached way *O(N)* and *O(N²)*.

# %% [markdown]
# ## 3 · What one token of cache costs
#
# For every token the cache keeps one key and one value vector per layer and per KV head:
#
# $$\text{bytes per token} = 2 \cdot \text{layers} \cdot \text{kv\_heads}
#   \cdot \text{head\_dim} \cdot \text{bytes per element}$$
#
# SmolLM2-135M uses **grouped-query attention (GQA)**: its 9 query heads share 3 KV heads,
# so it stores 3× less K/V than a full multi-head (MHA) model of the same shape would.

# %%
spec = engine.runner.kv_spec
print(f"layers={spec.num_layers}, kv_heads={spec.num_kv_heads}, head_dim={spec.head_dim}")
print(f"query heads={engine.runner.num_heads}")

# %% [markdown]
# **Check yourself.** Before you run the next cell: how many bytes does one token's K/V
# take in bf16 (2 bytes per element)? Write the number in place of `None` and run the cell.

# %%
my_bf16_bytes = None  # your answer, a whole number of bytes
ask("01.kv-bytes-bf16", my_bf16_bytes, spec=spec)

# %%
for dtype in (torch.float32, torch.bfloat16):
    per_token = spec.bytes_per_token(dtype)
    mha = per_token * engine.runner.num_heads // spec.num_kv_heads
    print(f"{str(dtype):15} {per_token:>6,} bytes/token (MHA would need {mha:,})")

# %% [markdown]
# Compare with the weights themselves (the parameters, counted once even where the
# embedding and the LM head share a tensor):

# %%
n_params = weight_bytes(model.hf_model) // model.dtype.itemsize
per_token = spec.bytes_per_token(torch.float32)
print(f"parameters: {n_params:,}")
print(f"fp32 weights: {4 * n_params / 2**20:.1f} MiB, bf16 weights: {2 * n_params / 2**20:.1f} MiB")
print(f"fp32 KV of one 8192-token sequence: {8192 * per_token / 2**20:.1f} MiB")
print(f"tokens of fp32 KV that weigh as much as the fp32 weights: {4 * n_params // per_token:,}")

# %% [markdown]
# ## 4 · How a naive reservation grows
#
# The simplest way to give each user a cache is to reserve, when the request arrives, a
# buffer for the longest sequence it may ever reach (`max_model_len`). Reserved memory is
# then `users × max_model_len × bytes per token`, whatever the users actually write. The
# dashed line is the model's weights: a few users with long contexts already reserve more
# than the whole model.
#
# **Check yourself.** A GPU has 8 GiB left for K/V after the weights. With a naive cache
# in bf16 and `max_model_len=8192`, how many users can it serve at once? Compute it from
# `spec` (the figure below is in this notebook's dtype, so it will not tell you).

# %%
my_users = None  # your answer: a whole number of users (a line of Python is fine)
ask("01.naive-users", my_users, spec=spec)

# %%
dtype = engine.runner.dtype
per_token = spec.bytes_per_token(dtype)
users = list(range(1, 65))
fig = go.Figure(
    [
        go.Scatter(x=users, y=[u * ctx * per_token / 2**30 for u in users], name=f"{ctx} tokens")
        for ctx in (1024, 2048, 8192)
    ],
    layout=dict(
        title=f"Naive KV reservation ({dtype}, {per_token} bytes/token)",
        xaxis_title="concurrent users",
        yaxis_title="reserved KV (GiB)",
        legend_title="max_model_len",
        height=380,
    ),
)
fig.add_hline(
    y=weight_bytes(model.hf_model) / 2**30, line_dash="dash", annotation_text="model weights"
)
fig.show()

# %% [markdown]
# ### Live: the naive cache serving 8 chat prompts
#
# Now a real run. This engine uses `cache="naive"`: each admitted request gets one
# contiguous region of `max_model_len=1024` token slots. The budget holds 4×1024 slots, so
# 4 requests run at once and the rest wait. The answers are capped at 16 tokens (32 with
# `FULL_SIZE`), so almost all of each region stays empty: reserved but never written.
#
# Watch the `running` and `waiting` columns: that is continuous batching. Step 1 is the
# prefill of the first 4 prompts, then decode steps follow; as soon as a request
# finishes, its region is released, and the next step is the prefill of a waiting
# request, which then decodes alongside the others.

# %%
naive = kvlab.Engine(
    model, kvlab.EngineConfig(cache="naive", max_model_len=1024, kv_budget_tokens=4 * 1024)
)
outputs = naive.generate(
    texts.chat_prompts()[:8], kvlab.SamplingParams(max_new_tokens=ANSWER_TOKENS)
)
stats = naive.stats()
print(stats[["step", "phase", "running", "waiting", "reserved_bytes", "live_bytes"]].head(10))

# %%
fig = go.Figure(
    [
        go.Scatter(x=stats["step"], y=stats[col] / 2**20, name=name, fill="tozeroy")
        for col, name in (("reserved_bytes", "reserved"), ("live_bytes", "live (written)"))
    ],
    layout=dict(
        title="Naive cache: reserved vs live KV per engine step",
        xaxis_title="engine step",
        yaxis_title="KV memory (MiB)",
        height=380,
    ),
)
fig.show()

# %%
busy = stats[stats["reserved_bytes"] > 0]
waste = busy["waste_bytes"] / busy["reserved_bytes"]
peak_step = int(busy.loc[waste.idxmax(), "step"])
print(f"peak waste: {waste.max():.1%} of reserved KV (step {peak_step})")
print(f"mean waste over the run: {waste.mean():.1%}")
print(f"most requests waiting at once: {stats['waiting'].max()}")
refills = stats[(stats["phase"] == "prefill") & (stats["step"] > 1)]["step"].tolist()
print("steps that admitted a waiting request:", refills)

# %% [markdown]
# ## 5 · Try it: the latency explorer
#
# The widget below re-runs both decoders on the real model whenever you **move a
# slider**: the prompt length and the number of new tokens. Watch the no-cache curve get
# steeper as the prompt grows, while the cached curve stays flat. (Each move takes a few
# seconds on a laptop CPU; keep the values small at first.)

# %%
# NBVAL_IGNORE_OUTPUT
from kvlab.viz.why_cache import CacheLatencyExplorer  # noqa: E402

text_ids = model.tokenizer.encode(texts.heldout())[:512]
CacheLatencyExplorer(engine.runner, text_ids, prompt_len=32, new_tokens=16)

# %% [markdown]
# > **Summary.**
# > * Without a cache, every new token re-runs the model over the whole context: the
# >   linears do *O(n)* work per token, attention *O(n²)*. With a cache, one token runs
# >   through the model and reads the earlier tokens' K/V: the same tokens come out, and
# >   the time per token stays nearly flat as the context grows.
# > * The price is memory: `2 × layers × kv_heads × head_dim × bytes` per token, for every
# >   token of every sequence (23,040<!-- out --> bytes in bf16 for SmolLM2-135M, which
# >   shares 3 KV heads among 9 query heads).
# > * An engine works in **steps**: schedule a batch, one forward, sample. With
# >   **continuous batching** a finished request leaves and a waiting one joins at the
# >   next step.
# > * Reserving `max_model_len` slots per request (the naive cache) wastes most of the
# >   memory it reserves: notebook 02 pages it.

# %% [markdown]
# ## What to try next
#
# * Set `prompt_len` to 256 or more in the explorer: how does the no-cache latency scale?
# * Add 2,048 and 4,096 to `CONTEXTS` (a few minutes more on a CPU): where does the
#   no-cache curve start to bend upwards, as attention's share grows?
# * Re-run the live naive run with `max_model_len=4096`: the waste fraction only grows.
# * Notebook **02** replaces the contiguous regions with a **paged** cache: small
#   fixed-size blocks handed out as tokens are written, found through a block table,
#   so the reserved memory follows the live memory.
#
# The stored timings and figures in this notebook come from the machine below (a 2-core
# CPU unless it says otherwise); yours will differ in scale, not in shape.

# %%
# NBVAL_IGNORE_OUTPUT
print(f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, {device}")
