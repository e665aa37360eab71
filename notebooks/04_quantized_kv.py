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
# # 04 · Quantized KV: the bytes and the damage
#
# *Engine files shown here:* `kvlab/cache/codecs/` (`int8.py`, `quant.py`, `fp8.py`, `int4.py`,
# `kivi2.py`, `base.py`), `kvlab/cache/pool.py`, `kvlab/experiments/quality.py`.
#
# *Lesson plan (50 min):* sections 1-2 and 4 with their three "check yourself" cells;
# section 3's codec picker and section 5's frontier are for the learner's own time.
#
# The KV cache stores every token's keys and values in every layer. Store them in fewer
# bits and the same memory holds more tokens, so more requests run at once. But the
# model then attends to *approximations* of its own keys and values. This notebook
# measures both sides on the real model (SmolLM2-135M-Instruct, fp32 on this CPU):
#
# 1. what each **codec** stores, and the bytes per token it costs, scales included; and
#    the other way to shrink a token, storing fewer vectors (MQA, MLA);
# 2. what real K and V look like, and why keys have **outlier channels** (the reason
#    [KIVI](https://arxiv.org/abs/2402.02750) quantizes keys per channel);
# 3. the **damage**: perplexity on held-out text, KL divergence from the baseline's
#    next-token distributions, greedy-token agreement, K/V error, each with the sample
#    it rests on, and which differences that sample can tell from **noise**;
# 4. the **gain**: how many doc-QA requests one KV budget holds with each codec.
#
# Set-up: one cell picks the device (CUDA if present, else CPU), seeds torch and loads
# the model. The default sizes fit a class: perplexity on 512 tokens of prose, greedy
# agreement along the answers to 8 chat prompts (up to 16 tokens each), 4 of them also
# answered freely by every codec. `FULL_SIZE = True` scores 1,024 tokens, all 64 prompts
# with answers of up to 48 tokens, 16 answered freely (several more minutes on a CPU):
# the intervals narrow, the conclusions stay.

# %%
import os
import platform
import time

import plotly.io as pio
import torch

import kvlab
from kvlab import texts, workloads
from kvlab.cache.codecs.int8 import Int8
from kvlab.cache.codecs.quant import quantize_symmetric
from kvlab.course import ask, show_source
from kvlab.experiments import quality
from kvlab.model.runner import ModelRunner
from kvlab.viz.quantization import (
    CodecExplorer,
    capacity_figure,
    channel_magnitude,
    channel_magnitude_figure,
    codec_frontier_figure,
    layer_histograms,
)

pio.renderers.default = "plotly_mimetype"
torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
model = kvlab.load_model(device=device, progress=False)
runner = ModelRunner(model.hf_model)
FULL_SIZE = False  # True: 1,024 tokens of prose; all 64 chat prompts, 16 answered freely
PROMPTS, FREE_RUN = (64, 16) if FULL_SIZE else (8, 4)
FIRST = 0 if FULL_SIZE else 4  # the first chat prompt scored
NEW_TOKENS = 48 if FULL_SIZE else 16  # each answer's greedy tokens, at most
TEXT_TOKENS, CHUNK = (1024, 128) if FULL_SIZE else (512, 128)  # prose scored, prefill chunk

# %% [markdown]
# ## 1 · Seven codecs, one interface
#
# `EngineConfig(kv_codec=...)` picks how the pool stores K/V: quantize on write,
# dequantize on read. Scaled codecs keep a **scale** (bfloat16, 2 bytes) beside the
# codes: one per token per kv head (int8, fp8), one per 32 channels (int4), or, for
# KIVI's keys, one scale and zero point *per channel* over a group of 16 tokens. The
# scales are memory too, so they are counted in the bytes per token, and a byte budget
# buys `budget // bytes_per_token` slots.
#
# A codec is two functions: `encode` on the way in (the pool's `write`), `decode` on
# the way out (its `gather`). int8's, from kvlab's source: `encode` takes each token's
# largest magnitude per head (`amax`) as 127 codes' worth, so the scale is `amax / 127`,
# stored in bf16 beside the codes; `decode` multiplies back. Look for where the scale's
# shape comes from (`amax(-1)`: one per token per head) and where rounding loses
# information (`round()`: at most half a scale step per element).

# %%
show_source(Int8, "def encode", "return (q.float()")

# %%
show_source(quantize_symmetric)

# %% [markdown]
# **Check yourself.** The model's KV shape is printed below. Before the table: how many
# bytes does one token take in the **int8** cache, scales included? Compute it in a line
# of Python (`spec.num_layers`, `spec.num_kv_heads`, `spec.head_dim`) and run the cell.

# %%
spec = runner.kv_spec
print(f"{spec.num_layers} layers x {spec.num_kv_heads} kv heads x head_dim {spec.head_dim}")

# %%
my_int8_bytes = None  # your answer: a whole number of bytes, or a line of Python computing it
ask("04.int8-bytes", my_int8_bytes, spec=spec)

# %%
table = quality.bytes_table(spec, runner.dtype)
shown = {"bytes_per_token": "{:,}".format, "x_smaller": "{:.2f}".format}
print(table.to_string(index=False, formatters=shown))

# %% [markdown]
# int8 is 64 code bytes + 2 scale bytes per head per layer, for K and for V:
# 2 x 30 x 3 x 66 = 11,880<!-- out --> bytes, a little over half of fp16's 23,040<!-- out -->.
# kivi2's values carry a scale and zero point per token, and its keys one per channel
# shared by 16 tokens, which is why 2 bits cost more than a quarter of int8.
#
# ### The other lever: fewer vectors per token
#
# A codec stores the same vectors in fewer bits. The model's **attention layout** decides
# how many vectors there are. Multi-head attention (MHA) keeps a K and a V head per query
# head; SmolLM2 uses grouped-query attention (GQA: 3 K/V heads shared by its 9 query
# heads); multi-query attention (MQA) keeps one K/V head for all. DeepSeek's multi-head
# latent attention (MLA, [DeepSeek-V2, sec. 2.1](https://arxiv.org/abs/2405.04434))
# stores **one latent vector per token per layer**, from which every head's K and V are
# recomputed, and no separate V. vLLM sizes its pages accordingly: an attention page holds
# `head_size + head_size_v` elements per token per KV head, and its
# [`MLAAttentionSpec`](https://github.com/vllm-project/vllm/blob/main/vllm/v1/kv_cache_interface.py)
# sets `head_size_v = 0` ("MLA stores a single latent vector per state; there is no
# separate V"): a coefficient of 1 where K and V take 2 (earlier releases computed an MLA
# page as `block_size x num_kv_heads x head_size` bytes, without the 2). The layout is
# fixed when the model is trained; a codec then multiplies the saving on any of them.
#
# **Check yourself.** DeepSeek-V2's latent is 4 x head_dim, plus a head_dim / 2 RoPE key
# (512 + 64 = 576 elements for its head_dim of 128). For this model's head_dim of 64 that
# is `latent` = 288 elements. How many bytes per token would this model's KV take in bf16
# with MLA? Write a line of Python.

# %%
latent = quality.mla_latent(spec.head_dim)
my_mla_bytes = None  # your answer: a line of Python using spec.num_layers and latent
ask("04.mla-bytes", my_mla_bytes, spec=spec, latent=latent)

# %%
heads = runner.num_heads
layouts = quality.attention_layouts(spec, heads, torch.bfloat16, latent)
shown = {"bytes_per_token": "{:,}".format, "x_smaller_than_mha": "{:.2f}".format}
print(f"{spec.num_layers} layers, head_dim {spec.head_dim}, {heads} query heads, in bf16:")
print(layouts.to_string(index=False, formatters=shown))

# %% [markdown]
# MQA is the smallest, 7,680<!-- out --> bytes, 9x less than MHA's 69,120<!-- out -->, and
# the weakest: one K/V head must serve every query head. MLA's latent, 17,280<!-- out -->
# bytes, costs less than this model's GQA and, in DeepSeek-V2's ablations, matches or
# beats MHA's quality: the latent is compressed, not shared. An int8 codec on top halves
# any of these rows again.
#
# ## 2 · Real keys and values
#
# `quality.teacher_forced` feeds the first `TEXT_TOKENS` (512; 1,024 at full size) tokens
# of kvlab's held-out prose through kvlab's own forward pass in chunks of `CHUNK` (128),
# like a chunked prefill: each chunk attends to the K/V that earlier chunks wrote
# **through the codec**. The baseline and all seven codecs run in lockstep on the same
# text, so every codec is scored on the same tokens as the baseline: their per-token
# losses are *paired*, which section 4 uses to tell a real change from noise. It also
# keeps the baseline's K and V (keys after RoPE, as the cache stores them) for the plots
# below.

# %%
# NBVAL_IGNORE_OUTPUT
ids = quality.heldout_ids(model, TEXT_TOKENS + 1)
start = time.perf_counter()
forcing = quality.teacher_forced(runner, ids, chunk=CHUNK)
print(f"{len(ids) - 1} tokens x 8 configurations in {time.perf_counter() - start:.0f} s")

# %% [markdown]
# Every layer's K and V values at once (log count of values per bin). Keys spread much
# wider than values, and their tails are long.

# %%
# NBVAL_IGNORE_OUTPUT
layer_histograms(forcing.k, forcing.v).show()

# %% [markdown]
# ### Why keys are quantized per channel
#
# Average |K| and |V| per channel at one layer: a handful of key channels are large in
# *every* token. A per-token scale must stretch to cover them, so every other channel of
# that token gets only a few of the 15 (int4) or 4 (2-bit) levels. Values have no such
# columns. KIVI therefore gives each key **channel** its own scale (over a group of
# tokens) and each value **token** its own.

# %%
# NBVAL_IGNORE_OUTPUT
layer = 12
channel_magnitude_figure(forcing.k, forcing.v, layer).show()

# %%
channels = channel_magnitude(forcing.k, forcing.v, layer)
for what in ("k", "v"):
    col = channels[f"{what}_mean_abs"]
    top = channels.nlargest(3, f"{what}_mean_abs")["channel"].tolist()
    print(f"{what.upper()}: largest channel / median = {col.max() / col.median():.3g}, top {top}")

# %% [markdown]
# ## 3 · The codec picker
#
# Pick a codec and a layer: the top row shows that layer's K and V values, the bottom
# row the codec's error on them (written through a `KVPool` with that codec, read back).
# Compare int4 (per token) with kivi2 (keys per channel) on the keys.

# %%
# NBVAL_IGNORE_OUTPUT
CodecExplorer(forcing.k, forcing.v, codec="int4", layer=layer)

# %% [markdown]
# ## 4 · Damage and gain, per codec
#
# `quality.codec_report` adds to the teacher-forced scores:
#
# * **greedy agreement**: the paged engine answers `PROMPTS` of kvlab's 64 chat prompts,
#   spread over the list (every 8th from the 4th, so 8; all 64 at full size), greedily
#   (to EOS, at most `NEW_TOKENS` = 16 tokens each) without a codec; then, at every step of
#   those answers, does the codec pick the same greedy token given the same history? Each
#   step reads its K/V back through the codec, as a decode step does (all 8 prompts in
#   one batch per codec). `steps_compared` is how many steps that is, `greedy_misses`
#   how many differed. `free_run_agreement` lets each codec answer the first `FREE_RUN`
#   (4; 16 at full size) on its own instead: it is strict, since after a first difference
#   the rest of the answer usually differs too, so one near-tie between two tokens costs
#   a whole answer;
# * **K/V error**: the codec alone, on the baseline's real K/V;
# * **capacity**: how many of 128 doc-QA requests (a ~300-token preamble, a document
#   and a question; 8-24 answer tokens) the paged cache admits at once from a full
#   queue with 512 MiB of KV, reserving each request's worst case (prompt + answer) as
#   `admission="reserve"` does, so every request counted runs to its end. This is
#   counted by the cache's own admission check, not by running the requests. kivi2
#   also keeps each sequence's last 0-15 tokens in full precision (its window); that
#   memory is taken out of its budget first.

# %%
# NBVAL_IGNORE_OUTPUT
budget = 512 * 2**20
requests = workloads.doc_qa(n=128, long_fraction=0.0)
start = time.perf_counter()
report = quality.codec_report(
    model,
    forcing=forcing,
    prompts=texts.chat_prompts()[FIRST :: 64 // PROMPTS][:PROMPTS],
    new_tokens=NEW_TOKENS,
    free_run=FREE_RUN,
    budget_bytes=budget,
    requests=requests,
)
print(f"report in {time.perf_counter() - start:.0f} s")

# %%
# NBVAL_IGNORE_OUTPUT
columns = ["codec", "bytes_per_token", "ppl", "ppl_increase_pct", "ppl_pct_low", "ppl_pct_high",
           "kl", "top1_agreement", "greedy_agreement", "greedy_misses", "free_run_agreement",
           "k_mean_err", "v_mean_err", "capacity", "capacity_x"]  # fmt: skip
print(report[columns].to_string(index=False, float_format=lambda x: f"{x:.3g}"))
first = report.iloc[0]
print(f"samples: perplexity, KL and top-1 on {first['tokens_scored']} tokens; greedy agreement "
      f"on {first['steps_compared']} steps of {PROMPTS} answers; free runs: "
      f"{first['free_run_answers']} answers")  # fmt: skip

# %% [markdown]
# **How much text is enough?** A perplexity change is a mean over tokens, so it has a
# sampling error. Because every codec scores the *same* tokens as the baseline, the
# error is that of the per-token *differences* of loss, which vary far less than the
# losses themselves: `ppl_pct_low` and `ppl_pct_high` are the change's 95% interval
# (1.96 standard errors of the mean difference, tokens taken as independent). Where it
# holds 0, this much text cannot tell the codec from the baseline: the change is
# **noise**, whatever its sign. (An earlier version of this notebook scored 128 tokens
# and printed int8 "improving" perplexity by 0.8%: noise of exactly this kind.) The
# interval narrows with the square root of the tokens: `FULL_SIZE`'s 1,024 tokens make it
# about 1.4x narrower, not different in kind.
#
# **Check yourself.** Read int8's row above: its perplexity change and the interval
# around it. Does int8 make perplexity go `"up"`, `"down"`, or is the change `"noise"`?

# %%
my_int8_verdict = None  # "up", "down" or "noise"
ask("04.int8-noise", my_int8_verdict, report=report)

# %%
# NBVAL_IGNORE_OUTPUT
by = report.set_index("codec")
verdicts = quality.beyond_noise(report).set_axis(report["codec"])
print("perplexity change beyond noise?", verdicts.to_dict())
print(f"greedy misses of {by.loc['baseline', 'steps_compared']} steps:",
      by["greedy_misses"].to_dict())  # fmt: skip
targets = {  # the perplexity targets hold for the upper end of the 95% interval
    "int8 perplexity increase <= 1%": by.loc["int8", "ppl_pct_high"] <= 1,
    "fp8_e4m3 perplexity increase <= 3%": by.loc["fp8_e4m3", "ppl_pct_high"] <= 3,
    "int8 greedy agreement >= 98%": by.loc["int8", "greedy_agreement"] >= 0.98,
    "int8 holds >= 1.9x fp16's requests": by.loc["int8", "capacity"]
    >= 1.9 * by.loc["fp16", "capacity"],
}
for target, met in targets.items():
    print(f"{target}: {'met' if met else 'MISSED'}")

# %% [markdown]
# Read the table from the top, with its sample sizes in mind:
#
# * **Perplexity.** fp16's change, -0.017<!-- out -->%, is the only small one whose
#   interval excludes 0: real, because fp16 rounds so little that its per-token
#   differences barely vary, and still a fiftieth of a percent. *Beyond noise* is not
#   *large*. bf16, int8 (-0.0673<!-- out -->%, interval -0.388<!-- out --> to
#   0.254<!-- out -->) and fp8 e4m3 are **noise** at 512 tokens: this text cannot tell
#   them from the baseline. fp8 e5m2 (2 mantissa bits) is up, by 2.04<!-- out -->%; int4
#   and the 2-bit kivi2 far up, by 15.7<!-- out -->% and 56<!-- out -->%.
# * **KL and top-1** order the codecs the same way: e4m3 (3 mantissa bits) moves the
#   next-token distributions more than int8, e5m2 more again.
# * **Greedy steps.** int8 chose differently at 2<!-- out --> of 128<!-- out --> steps,
#   the fp8 formats at 5-6; counts that small cannot rank int8 against fp8 (one or two
#   near-ties more or less), but int4 (21<!-- out -->) and kivi2 (37<!-- out -->) are
#   clearly worse. Free-running answers differ more often than the stepwise choices:
#   where two tokens nearly tie, a tiny change of the logits flips the choice once, and
#   the rest of that answer goes its own way (the free-run column counts every later
#   token as a miss). On 4 answers that column is coarse, and which near-ties flip
#   depends on the CPU's rounding; `FULL_SIZE` answers 16 freely.
# * int4 and kivi2 cost a lot on a model this small: 135M parameters leave little
#   redundancy to absorb the noise. Compare the mean key error of int4 (4 bits, per
#   token) with kivi2 (2 bits, per channel): per-channel grouping is what makes 2-bit
#   keys usable at all.

# %%
ratio = by.loc["int8", "capacity"] / by.loc["fp16", "capacity"]
byte_ratio = by.loc["fp16", "bytes_per_token"] / by.loc["int8", "bytes_per_token"]
print(f"int8 holds {by.loc['int8', 'capacity']} requests, fp16 {by.loc['fp16', 'capacity']}:")
print(f"  ratio {ratio:.3g} (bytes per token ratio {byte_ratio:.3g})")

# %% [markdown]
# ## 5 · The frontier
#
# Bytes per token against the damage. Points to the left hold more requests; points
# lower on the left panel (and higher on the right) hurt less.

# %%
# NBVAL_IGNORE_OUTPUT
codec_frontier_figure(report).show()

# %%
capacity_figure(report, budget).show()

# %% [markdown]
# > **Summary.**
# > * A codec stores each token's K/V in fewer bits plus the **scales** to decode them;
# >   the scales are memory too (int8: 11,880<!-- out --> bytes per token here, not half
# >   of fp16's 23,040).
# > * The attention layout decides how many vectors a token stores: MQA one K/V head,
# >   MLA one latent per layer and no separate V (vLLM's page coefficient 1 instead of 2).
# >   It is fixed at training; a codec multiplies on top.
# > * Keys have outlier channels, so per-token scales waste levels on them; KIVI scales
# >   keys **per channel** and makes 2-bit keys usable.
# > * A quality difference needs its sample size: perplexity changes come with a 95%
# >   interval from paired per-token losses, and one that holds 0 is **noise**. On this
# >   model fp16, bf16 and int8 cost nothing measurable; fp8 e5m2, int4 and kivi2 do.
# > * Capacity follows bytes per token: a budget buys `budget // bytes_per_token` slots.
#
# ## What to try next
#
# * Set `FULL_SIZE = True` (or call `quality.codec_report` with `text_tokens=2048`):
#   do the intervals of int8, fp16 and e4m3 still hold 0 as they narrow?
# * Serve a workload with `kvlab.Engine(model, kvlab.EngineConfig(cache="paged",
#   kv_codec="int8", kv_budget_bytes=...))` and compare `engine.stats()["running"]`
#   with the fp16 run: the capacity column, live.
# * Real engines differ: vLLM's fp8 KV uses one scale per tensor (often 1.0), so values
#   beyond fp8's range clip; that is one reason fp8 KV accuracy collapses on some models.
#   Here each token and head gets its own scale.
# * Notebook **06** fuses dequantization into the attention kernel on GPU, where these
#   codecs also save time, not only memory.
#
# The stored timings in this notebook come from the machine below (a 2-core CPU unless it
# says otherwise), with its load average when the run ended; the scores do not depend on
# the load, only the seconds do.

# %%
# NBVAL_IGNORE_OUTPUT
machine = platform.processor() or platform.machine()
print(f"{machine}, {os.cpu_count()} cores, torch on {torch.get_num_threads()} threads, {device}")
print("load average (1, 5, 15 min):", ", ".join(f"{x:.2f}" for x in os.getloadavg()))
