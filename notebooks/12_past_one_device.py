# ---
# jupyter:
#   jupytext:
#     cell_metadata_filter: -all
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
# ---

# %% [markdown]
# # 12 · Past one device: tensor-parallel KV and disaggregated prefill/decode
#
# *Engine files shown here:* `kvlab/parallel/` (`shard.py`, `runner.py`, `pool.py`,
# `worker.py`), `kvlab/disagg/` (`prefill.py`, `transfer.py`, `pair.py`),
# `kvlab/experiments/tensor_parallel.py`, `kvlab/experiments/disagg.py`.
#
# KV leaves a single device in two ways. Under **tensor parallelism** the model's heads
# are split across ranks and each rank stores the KV of its own KV heads, over one block
# table. In **disaggregated serving** one engine prefills a prompt and another decodes
# it: the prompt's KV blocks travel between them. Both run here for real, as processes on
# this machine (gloo all-reduces; a local socket for the KV), so their bookkeeping can be
# checked: tokens identical to one engine, KV bytes per rank, bytes moved.
#
# Set-up: one cell loads the model. `FULL_SIZE = True` runs the earlier, larger workloads
# (8 tokens per tensor-parallel answer; long prompts of 2,400 characters, 1 s apart, among
# 32-token chats); the default keeps each section's effect at a fraction of the time.

# %%
import pandas as pd
import plotly.io as pio
import torch

import kvlab
from kvlab import texts
from kvlab.experiments import disagg, tensor_parallel
from kvlab.viz.parallel import kv_per_rank_figure, latency_figure

pio.renderers.default = "plotly_mimetype"
torch.manual_seed(0)
model = kvlab.load_model(device="cpu", progress=False)
cfg = model.config
FULL_SIZE = False  # True: 8-token tp answers; 2,400-character long prompts, 32-token chats
TP_TOKENS = 8 if FULL_SIZE else 2  # greedy tokens per prompt at each tp (2: one decode step)
LONG_CHARS, CHAT_TOKENS, GAP_S = (2400, 32, 1.0) if FULL_SIZE else (600, 8, 0.25)
print(f"{cfg.num_attention_heads} query heads, {cfg.num_key_value_heads} KV heads, "
      f"{cfg.num_hidden_layers} layers")  # fmt: skip

# %% [markdown]
# ## 1 · Tensor parallel: which sizes, and what each rank holds
#
# A rank takes `heads / tp` query heads, so `tp` must divide the 9 query heads: 1, 3 or
# 9. Anything else is refused before a process starts:

# %%
print("valid sizes:", tensor_parallel.valid_sizes(model))
try:
    kvlab.Engine(model, kvlab.EngineConfig(cache="paged", tensor_parallel_size=2))
except ValueError as error:
    print("ValueError:", error)

# %% [markdown]
# Each size below starts its ranks as processes (rank 0 here runs the scheduler and the
# cache; ranks 1 .. tp - 1 load the checkpoint and keep their slices), generates 2 tokens
# for each of two chat prompts (a prefill step and one decode step), and reports what one
# rank stores. Past tp = 3 the 3 KV heads cannot be split further: at tp = 9 each KV head
# is replicated on three ranks, and per-rank KV stays at one head's worth.

# %%
rows = tensor_parallel.run_tp(model, texts.chat_prompts()[:2], [1, 3, 9], TP_TOKENS)
table = pd.DataFrame.from_dict(rows, orient="index")
print(table[["kv_heads_per_rank", "kv_bytes_per_token_per_rank", "all_reduces_per_step",
             "identical_to_tp1"]].to_string())  # fmt: skip

# %%
kv_per_rank_figure(rows, cfg.num_key_value_heads).show()

# %% [markdown]
# Two all-reduces per layer per step (after the attention output projection and after the
# MLP's down projection): 60 per step for 30 layers. On this CPU the ranks share the same
# cores, so tensor parallelism costs time here (start-up and decode speed below); on GPUs
# each rank reads only its slice of the weights, which is the point.

# %%
# NBVAL_IGNORE_OUTPUT
print(table[["startup_s", "decode_tok_per_s"]].to_string())

# %% [markdown]
# ## 2 · Disaggregated prefill/decode under long-prompt interference
#
# Four chat requests decode 8 tokens each while two long prompts (the first 600
# characters of two doc-QA prompts, ~120 tokens each) arrive among them, 0.25 s apart.
# **Colocated**, each long prefill is a step every running decode waits for (chunked
# prefill splits it into smaller stalls). **Disaggregated**, a second process prefills; the
# decode engine admits the finished KV as it would swap a preempted request back in. The
# greedy tokens must be the same in all three setups, and the bytes moved exactly the
# prompts' KV bytes:

# %%
trace = disagg.interference_trace(n_chat=4, n_long=2, chat_tokens=CHAT_TOKENS, long_tokens=4,
                                  gap_s=GAP_S, long_chars=LONG_CHARS)  # fmt: skip
setups = disagg.colocated_vs_disaggregated(model, trace)
prompt_tokens = sum(len(model.tokenizer(r.prompt).input_ids) for r in trace[4:])
print({name: row["identical_to_colocated"] for name, row in setups.items()})
print("transfers rejected:", setups["disaggregated"]["transfers_rejected"])

# %% [markdown]
# The latencies, measured on this machine (timings vary from run to run):

# %%
# NBVAL_IGNORE_OUTPUT
print("KV bytes moved:", setups["disaggregated"]["bytes_moved"])
print(pd.DataFrame({n: {"ttft p50": r["ttft_s"]["p50"], "itl p50": r["itl_s"]["p50"],
                        "itl p99": r["itl_s"]["p99"], "tok/s": r["tokens_per_s"]}
                    for n, r in setups.items()}).T.to_string())  # fmt: skip
latency_figure(setups).show()

# %% [markdown]
# What this shows and does not: both processes share this machine's two cores, so the
# prefill process still takes CPU time from the decodes. What disaggregation removes is
# the *step* a long prefill forces on every decode: with its own device, the decode
# engine's inter-token latency would no longer depend on who is prefilling. As vLLM's
# docs say, it does not raise throughput; it decouples time to first token from
# inter-token latency.
#
# ## 3 · The way on: the same workload on a real vLLM deployment
#
# kvlab's processes teach the mechanism; when a model outgrows one machine, vLLM is what
# runs it. The same workload file replays against any OpenAI-compatible endpoint
# (`kvlab replay`, from the serve issue), so the figures above can be set beside a real
# deployment's:
#
# ```
# # tensor parallel on 4 GPUs, pipeline parallel over 2 nodes (Ray):
# vllm serve meta-llama/Llama-3.1-70B-Instruct --tensor-parallel-size 4 \
#     --pipeline-parallel-size 2 --distributed-executor-backend ray
# # disaggregated prefill/decode with a KV connector (one prefill, one decode instance):
# vllm serve MODEL --kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'
# # the same trace against it:
# kvlab replay --workload trace.jsonl --endpoint http://HOST:8000 --tokenizer MODEL
# ```
