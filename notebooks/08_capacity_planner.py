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
# ---

# %% [markdown]
# # 08 · Capacity planner
#
# *Engine files shown here:* `kvlab/planner/plan.py`, `kvlab/planner/shape.py`,
# `kvlab/experiments/capacity_check.py`.
#
# How many users can one accelerator serve? Before renting a GPU, a serving engineer
# works it out on paper:
#
# ```
# KV capacity (tokens) ≈ (memory × utilization − weights − activations) / KV bytes per token
# KV bytes per token   = 2 (K and V) × layers × KV heads × head_dim × bytes per element
# ```
#
# and then divides the capacity among the sequences: a **paged** cache holds a sequence
# of *C* tokens in ⌈*C* / block_size⌉ blocks, a **naive** cache reserves `max_model_len`
# slots for every sequence whatever its length.
#
# `kvlab.planner` does this arithmetic from a model's HF `config.json` (five well-known
# ones ship with kvlab), and this notebook ends by **checking it against a live
# measurement**: kvlab's engine, given a byte budget, serves as many sequences at once as
# the planner predicts.
#
# Set-up: one cell picks the device (CUDA if present, else CPU), seeds torch and loads
# the model.

# %%
import os
import platform

import pandas as pd
import plotly.io as pio
import torch

import kvlab
from kvlab.course import ask, show_source
from kvlab.experiments.capacity_check import check_against_engine
from kvlab.planner import (
    MODELS,
    ModelShape,
    activation_bytes,
    capacity_curve,
    gqa_vs_mha,
    kv_bytes_per_token,
    plan,
    rank_shape,
    weight_bytes,
)
from kvlab.units import GiB
from kvlab.viz.planner import PlannerApp

pio.renderers.default = "plotly_mimetype"
torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
model = kvlab.load_model(device=device, progress=False)

# %% [markdown]
# ## 1 · Bytes per token, from a config
#
# `ModelShape.from_config` reads what the arithmetic needs from a config (a shipped name,
# a `config.json` path, a dict, or a loaded model's config). For the embedded
# SmolLM2-135M: 30 layers, 3 KV heads of 64 dimensions (GQA: 9 query heads share them).
# In fp32, as it runs on this CPU, one token's K and V in every layer cost
# 2 × 30 × 3 × 64 × 4 bytes. The engine's KV pool agrees:

# %%
smol = ModelShape.from_config(model.config)
engine = kvlab.Engine(model, kvlab.EngineConfig(max_model_len=256, kv_budget_tokens=256))
print(smol.attention)
print("planner, fp32 KV:  ", kv_bytes_per_token(smol, "fp32"), "bytes per token")
print("engine's KV pool:  ", engine.cache.pool.bytes_per_token, "bytes per token")
print("parameters:        ", f"{smol.num_params():,}", "(planner)")
print("                   ", f"{sum(p.numel() for p in model.hf_model.parameters()):,}", "(model)")

# %% [markdown]
# ## 2 · Five well-known models on one 80 GiB accelerator
#
# The planner's whole arithmetic is a dozen lines of `plan()`: the memory the server may
# use, less the weights and one step's activations, is the KV budget; divided by a token's
# KV bytes it gives token slots, and a sequence takes whole blocks of them. (`rank` is
# what one device holds: the whole model unless it is split over devices, section 3.)

# %%
show_source(plan, start="memory_bytes = parse_size", end="per_seq_blocks =")

# %% [markdown]
# **Check yourself.** Before the table below prints it: how many bytes of KV does one
# Llama-3-8B token take in bf16? Its shape:

# %%
llama = ModelShape.from_config("Llama-3-8B")
print(llama.attention, "|", llama.num_layers, "layers, head_dim", llama.head_dim)

# %%
my_llama_bytes = None  # your answer, a whole number of bytes
ask("08.kv-bytes-llama", my_llama_bytes, shape=llama)

# %% [markdown]
# Now the five models. Weights and KV in bf16, 90 % of memory usable (vLLM's default
# `gpu_memory_utilization`), activations estimated for a 4,096-token step. "paged @ 4k" is
# how many 4,096-token sequences fit; "naive" is how many fit when each reserves the
# model's whole context window, as a naive cache must.

# %%
rows = {}
for name in MODELS:
    p = plan(name, memory="80GiB", context_len=4096)
    rows[name] = {
        "params (B)": round(p.params / 1e9, 2),
        "attention": p.attention,
        "weights GiB": round(p.weight_bytes / GiB, 1),
        "KV bytes/token": p.kv_bytes_per_token,
        "KV tokens": p.kv_tokens,
        "paged @ 4k": p.paged_max_seqs,
        "naive": p.naive_max_seqs,
        "context window": p.max_model_len,
    }
print(pd.DataFrame.from_dict(rows, orient="index").to_string())

# %% [markdown]
# Llama-3-70B's **131.4**<!-- out --> GiB of bf16 weights do not fit in 80 GiB at all (no
# KV left: 0 sequences; section 3 splits it over several devices). Qwen2.5-7B keeps only 4
# KV heads for 28 query heads, so its KV costs **57344**<!-- out --> bytes per token, less
# than half of Llama-3-8B's, and its naive column shows what reserving a whole
# 131072<!-- out -->-token window per user does: 8<!-- out --> sequences where paging fits
# 261<!-- out -->.
#
# ## 3 · Past one device: tensor parallelism
#
# A model too big for one device is split over several. Tensor parallelism (vLLM's
# `tensor_parallel_size`) splits every layer: each of the tp devices holds 1/tp of the
# weights, computes its share of the query heads, and stores, for **every** token, the K
# and V of its share of the KV heads. So the KV per token per device is the model's
# divided by tp, until there are more devices than KV heads: then vLLM gives each device
# one KV head, replicated (`max(1, kv_heads // tp)` in `ModelConfig.get_num_kv_heads`,
# [vllm/config/model.py](https://github.com/vllm-project/vllm/blob/main/vllm/config/model.py);
# the split itself is `QKVParallelLinear` in
# [vllm/model_executor/layers/linear.py](https://github.com/vllm-project/vllm/blob/main/vllm/model_executor/layers/linear.py)).
# `plan(..., tensor_parallel_size=tp)` plans one device of tp; `rank_shape` is what it
# holds:

# %%
show_source(rank_shape, start="heads, kv = ", end="intermediate_size=")

# %% [markdown]
# **Check yourself.** Llama-3-70B has 80 layers and 8 KV heads of 128. Split over 4
# devices, how many bytes of KV does **each device** store per token, in bf16?

# %%
seventy = ModelShape.from_config("Llama-3-70B")
my_tp_bytes = None  # your answer, a whole number of bytes
ask("08.tp-kv-bytes", my_tp_bytes, shape=seventy, tensor_parallel_size=4)

# %% [markdown]
# The same 70B model on 1 to 16 devices of 80 GiB each, every figure per device:

# %%
rows = {}
for tp in (1, 2, 4, 8, 16):
    q = plan("Llama-3-70B", memory="80GiB", context_len=4096, tensor_parallel_size=tp)
    rows[tp] = {
        "weights GiB/device": round(q.weight_bytes / GiB, 1),
        "KV heads/device": q.kv_heads_per_rank or seventy.num_kv_heads,
        "KV bytes/token/device": q.kv_bytes_per_token,
        "KV tokens": q.kv_tokens,
        "paged @ 4k": q.paged_max_seqs,
    }
print(pd.DataFrame.from_dict(rows, orient="index").rename_axis("devices").to_string())

# %% [markdown]
# Two devices fit the weights with little room left for KV (8<!-- out --> sequences of
# 4,096 tokens); four leave more than half of each device's usable memory for KV, and each
# token's K/V there is a quarter of the model's: 123<!-- out --> sequences. At 8 devices
# each holds one KV head; at 16 that head is replicated on two devices, so the KV per
# token per device stays at 40960<!-- out --> bytes: the extra devices add room (their
# weight shard shrinks) but store the same heads twice. What the plan leaves out: the
# all-reduce traffic between devices at every layer (notebook 12), the norms every device
# keeps whole (a sliver), and activations, which this estimate splits with the heads and
# the MLP.
#
# ## 4 · One plan, read line by line
#
# Llama-3-8B on a 24 GiB card, 32 users at 4,096 tokens each:

# %%
p = plan("Llama-3-8B", memory="24GiB", context_len=4096, users=32)
print(p.summary())

# %% [markdown]
# Each term, from its function, so nothing is hidden:

# %%
w = weight_bytes(llama, "bf16")
a = activation_bytes(llama, "bf16", max_num_batched_tokens=4096, max_num_seqs=256)
kv_budget = int(24 * GiB * 0.9) - w - a
per_token = kv_bytes_per_token(llama, "bf16")
tokens = kv_budget // per_token
print(f"weights     {w:>15,} bytes  ({llama.num_params():,} params x 2)")
print(f"activations {a:>15,} bytes")
print(f"KV budget   {kv_budget:>15,} bytes  = 24 GiB x 0.9 - weights - activations")
print(f"KV tokens   {tokens:>15,}        = KV budget // {per_token:,}")
print(f"sequences   {tokens // 16 // 256:>15,}        = {tokens // 16:,} blocks // 256 blocks each")
assert tokens // 16 // 256 == p.paged_max_seqs

# %% [markdown]
# ## 5 · GQA vs MHA
#
# Grouped-query attention is a capacity feature: the same model with one KV head per
# query head (multi-head attention, as in Llama 2 7B) stores 4× the KV per token, and so
# fits about 4× fewer sequences in the same memory (56<!-- out --> against
# 13<!-- out --> at 8,192 tokens; its extra K/V weights take a little more memory too):

# %%
print(gqa_vs_mha("Llama-3-8B", memory="80GiB", context_len=8192).to_string())

# %% [markdown]
# ## 6 · Quantized KV
#
# Storing K/V in 8 bits (with a bf16 scale per token per head) halves the bytes per
# token; 4 bits and KIVI's 2 bits go further. The scales count, as kvlab's codecs count
# them, so int8 is not exactly half (**66560**<!-- out --> bytes, not 65,536):

# %%
rows = {}
for kv in ("bf16", "fp8_e4m3", "int8", "int4", "kivi2"):
    q = plan("Llama-3-8B", memory="80GiB", context_len=8192, kv_codec=kv)
    rows[kv] = {"KV bytes/token": q.kv_bytes_per_token, "sequences @ 8k": q.paged_max_seqs}
print(pd.DataFrame.from_dict(rows, orient="index").to_string())

# %% [markdown]
# ## 7 · Capacity against context length
#
# The paged line halves as the context doubles; the naive line is flat, because it always
# reserves the whole window; the MHA line is the paged one divided by 4. Where the paged
# and naive lines meet, every sequence uses its whole window and paging has nothing left
# to save.

# %%
curve = capacity_curve("Llama-3-8B", memory="80GiB")
print(curve.to_string(index=False))

# %% [markdown]
# ## 8 · The planner app
#
# Pick a model, the accelerator's memory, the dtypes, the context, the block size and
# the number of users; both panels follow at once. Left: max concurrent sequences
# against context length. Right: what the users need (weights, activations, KV) against
# the usable memory (dashed), for the model as shipped and for the same model with MHA.

# %%
# NBVAL_IGNORE_OUTPUT
app = PlannerApp(model="Llama-3-8B", memory_gib=24, context_len=4096, users=32)
app.widget()

# %% [markdown]
# Setting a widget from code does what moving it does. Halve the KV with int8, then
# find the context at which 32 users run out of memory:

# %%
app.kv_codec.value = "int8"
print(
    "int8 KV:", app.plan.paged_max_seqs, "sequences at 4,096 tokens;", app.figure.layout.title.text
)
print("32 users run out of memory at", f"{app.plan.oom_context:,}", "tokens each")
app.memory.value = 80
print("on 80 GiB:", app.plan.paged_max_seqs, "sequences;", app.figure.layout.title.text)

# %% [markdown]
# ## 9 · The check: planner vs the live engine
#
# A plan is only useful if it is right. Take the embedded model on an imaginary
# accelerator with exactly enough memory for its fp32 weights, its activations and
# **9 MB** of KV, and plan sequences of 32 tokens (a 24-token prompt and 8 new tokens):

# %%
weights = weight_bytes(smol, "fp32")
acts = activation_bytes(smol, "fp32", max_num_batched_tokens=4096, max_num_seqs=256)
tiny = plan(
    smol,
    memory=weights + acts + 9_000_000,
    weight_dtype="fp32",
    utilization=1.0,
    context_len=32,
    max_model_len=64,
)
print(tiny.summary())

# %% [markdown]
# `check_against_engine` gives kvlab's engine that KV budget in bytes, queues more
# 32-token requests than fit (distinct prompts, so nothing is shared) and records the
# most that ran at once. The same for the naive cache (each sequence reserving
# `max_model_len` = 64 slots) and for int8 KV on half the bytes (int8 buys ~3.9× the
# slots per byte):

# %%
checks = {
    "paged": check_against_engine(
        model, tiny.kv_budget_bytes, 24, 8, cache="paged", max_model_len=64
    ),
    "naive": check_against_engine(
        model, tiny.kv_budget_bytes, 24, 8, cache="naive", max_model_len=64
    ),
    "paged+int8": check_against_engine(
        model, tiny.kv_budget_bytes // 2, 24, 8, cache="paged", kv_codec="int8", max_model_len=64
    ),
}
for name, check in checks.items():
    print(
        f"{name:11} budget {check.kv_budget_bytes:>9,} B  predicted {check.predicted:3d}  "
        f"measured {check.measured:3d}  error {check.error:+.1%}"
    )
assert checks["paged"].predicted == tiny.paged_max_seqs
assert checks["naive"].predicted == tiny.naive_max_seqs

# %% [markdown]
# Predicted and measured agree exactly: 6<!-- out --> paged sequences, 3<!-- out -->
# naive and 11<!-- out --> with int8 on half the bytes (error **+0.0%**<!-- out --> each).
# The planner's arithmetic is the engine's arithmetic: bytes per token (scales included),
# whole blocks per sequence, and, for the naive cache, a whole `max_model_len` region per
# sequence. On a real GPU the fuzzy terms are the others: activations (this estimate
# assumes flash attention and counts one step's temporaries), the CUDA context and
# allocator fragmentation, which `utilization` leaves room for.
#
# **Check yourself.** Whole blocks cost slots: a sequence's last block is partly empty
# (internal fragmentation). With `block_size` = 256, how many token slots does a
# 300-token sequence hold that it never writes? Compute it in code.

# %%
my_waste = None  # your answer: an expression of 300 and 256
ask("08.block-waste", my_waste, context_len=300, block_size=256)

# %% [markdown]
# > **Summary.**
# > * KV bytes per token = 2 × layers × KV heads × head_dim × bytes per element (+ a
# >   codec's scales); the KV budget is memory × utilization − weights − activations.
# > * A paged cache runs ⌊blocks / ⌈context / block_size⌉⌋ sequences; a naive one
# >   ⌊tokens / max_model_len⌋, whatever the sequences' length.
# > * GQA, quantized KV and tensor parallelism buy sequences by shrinking the bytes per
# >   token each device stores; TP also splits the weights, the only way a 70B model fits
# >   80 GiB devices.
# > * On the embedded model, the planner's prediction is the engine's measured peak.
#
# ## What to try next
#
# * Plan your own model: `plan("path/to/config.json", memory="48GiB", ...)`, or
#   `kvlab plan --model path/to/config.json --memory 48GiB --context 8192 --users 64
#   --tensor-parallel-size 2`.
# * In the app, set the block size to 256 and the context to 300, then 512: when does a
#   big block stop costing sequences?
# * Compare `weight_dtype="int4"` with `kv_codec="int4"` for Llama-3-70B on 80 GiB:
#   which one makes room for users? And `tensor_parallel_size=2` with int8 KV?
# * Notebook 07 measures the same designs side by side on a real workload.

# %%
# NBVAL_IGNORE_OUTPUT
machine = platform.processor() or platform.machine()
print(f"{machine}, {os.cpu_count()} cores, torch on {torch.get_num_threads()} threads, {device}")
