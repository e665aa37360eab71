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
# # 01 · Why a KV cache
#
# *Engine files shown here:* `kvlab/engine/core.py` (the step loop), `kvlab/model/runner.py`
# (the forward that writes and reads K/V), `kvlab/cache/naive.py`,
# `kvlab/experiments/why_cache.py`.
#
# A language model writes one token at a time, and every new token attends to **all** the
# tokens before it. This notebook shows, on a real model (SmolLM2-135M-Instruct, running
# through kvlab's own forward pass), three things:
#
# 1. **Without a cache** each new token re-runs the model over the whole sequence so far;
#    **with a cache** it runs over just the new token and reads the earlier tokens' keys
#    and values (K/V) from memory. Same tokens out, very different time per token.
# 2. **The cache costs memory**: a fixed number of bytes for every token of every sequence.
# 3. **Reserving that memory naively** (a worst-case buffer per user) wastes most of it,
#    which is the problem the paged cache of notebook 02 solves.
#
# Set-up: one cell picks the device (CUDA if present, else CPU), seeds torch and loads
# the model. `FULL_SIZE = True` decodes 32 tokens in section 2 instead of 20 and lets
# section 4's answers run to 32 tokens instead of 16 (longer on a CPU).

# %%
import platform

import plotly.graph_objects as go
import plotly.io as pio
import torch

import kvlab
from kvlab import texts
from kvlab.experiments.why_cache import compare_decoding, weight_bytes

pio.renderers.default = "plotly_mimetype"
torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
model = kvlab.load_model(device=device, progress=False)
FULL_SIZE = False  # True: 32 new tokens per mode in section 2, answers of up to 32 in section 4
NEW_TOKENS = 32 if FULL_SIZE else 20  # section 2
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
# ## 2 · Decoding without and with the cache
#
# Inside an attention layer, token *t* needs the keys and values of tokens 0…*t*. Those
# K/V vectors never change once computed, so there are two ways to get them:
#
# * **no cache**: recompute them, i.e. run the whole sequence through the model again for
#   every new token: *O(n)* work per token, *O(n²)* in total;
# * **KV cache**: store each token's K/V the first time, and for every later token run the
#   model over just that one token.
#
# `kvlab.experiments.why_cache.compare_decoding` does both on the same prompt (a paragraph of the
# held-out text) and times every generated token.

# %%
paragraph = texts.heldout().split("\n\n")[9]  # "The great breakthrough was the pound lock..."
prompt_ids = model.tokenizer.encode(paragraph)
new_tokens = NEW_TOKENS
timings = compare_decoding(engine.runner, prompt_ids, new_tokens)
by_mode = {mode: rows["token"].tolist() for mode, rows in timings.groupby("mode")}
print(f"prompt: {len(prompt_ids)} tokens, {new_tokens} new tokens in each mode")
print("identical greedy tokens:", by_mode["no cache"] == by_mode["KV cache"])
print("continuation:", repr(model.tokenizer.decode(by_mode["KV cache"])))

# %% [markdown]
# Latency of each generated token against its position in the sequence. Without a cache
# the time grows with the position (the model re-reads everything); with a cache it
# stays flat and small. (The first token is the prompt's prefill in both modes.)

# %%
# NBVAL_IGNORE_OUTPUT
fig = go.Figure(
    [
        go.Scatter(x=rows["position"], y=rows["latency_s"] * 1e3, name=mode, mode="lines+markers")
        for mode, rows in timings.groupby("mode", sort=False)
    ],
    layout=dict(
        title="Time per generated token vs its position",
        xaxis_title="position of the generated token",
        yaxis_title="latency (ms)",
        height=380,
    ),
)
fig.show()

# %%
# NBVAL_IGNORE_OUTPUT
totals = timings.groupby("mode", sort=False)["latency_s"].sum()
print(totals.round(3).to_string())
print(f"speed-up with the cache: {totals['no cache'] / totals['KV cache']:.1f}x")

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
for dtype in (torch.float32, torch.bfloat16):
    per_token = spec.bytes_per_token(dtype)
    mha = per_token * engine.runner.num_heads // spec.num_kv_heads
    print(f"{str(dtype):15} {per_token:>6} bytes/token (MHA would need {mha})")

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
# ## What to try next
#
# * Set `prompt_len` to 256 or more in the explorer: how does the no-cache latency scale?
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
