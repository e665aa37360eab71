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
# # 12 · Past one device: tensor-parallel KV and disaggregated prefill/decode
#
# *Engine files shown here:* `kvlab/parallel/` (`shard.py`, `runner.py`, `pool.py`,
# `worker.py`), `kvlab/disagg/` (`prefill.py`, `connector.py`, `transfer.py`, `pair.py`,
# `routing.py`), `kvlab/experiments/tensor_parallel.py`, `kvlab/experiments/disagg.py`,
# `kvlab/viz/parallel.py`.
#
# KV leaves a single device in two ways. Under **tensor parallelism** the model's heads
# are split across ranks and each rank stores the KV of its own KV heads, over one block
# table. In **disaggregated serving** one engine prefills a prompt and another decodes
# it: the prompt's KV blocks travel between them. Both run here for real, as processes on
# this machine (gloo all-reduces; a local socket for the KV), so their bookkeeping can be
# checked: tokens identical to one engine, KV bytes per rank, bytes moved. What they
# cannot show on one 2-core CPU is speed: the ranks and the two engines share the same
# two cores, where on GPUs each would have a device of its own. Section 2 shows what that
# does to the figures, and why.
#
# Set-up: one cell loads the model. `FULL_SIZE = True` runs the earlier, larger workloads
# (8 tokens per tensor-parallel answer; long prompts of 2,400 characters, 1 s apart, among
# 32-token chats); the default keeps each section's effect at a fraction of the time.

# %%
import os
import platform

import pandas as pd
import plotly.io as pio
import torch
from IPython.display import display

import kvlab
from kvlab import texts
from kvlab.course import ask, show_source
from kvlab.disagg.pair import Disaggregated
from kvlab.disagg.routing import least_loaded
from kvlab.experiments import disagg, tensor_parallel
from kvlab.parallel.shard import kv_head_range, kv_heads_per_rank
from kvlab.viz.parallel import kv_per_rank_figure, latency_figure, pool_figure

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
# Which KV heads a rank stores. Up to tp = 3 each rank takes `3 / tp` of the KV heads,
# so its KV per token shrinks with tp. Past tp = 3 the 3 KV heads cannot be split
# further: each is *replicated*, held by the run of consecutive ranks whose query heads
# read it (`first = rank * kv_heads // tp`), and per-rank KV stays at one head's worth.
# These lines decide it, for the weights (`shard_layer`) and for each rank's KV pool:

# %%
display(show_source(kv_heads_per_rank))
show_source(kv_head_range)

# %% [markdown]
# **Check yourself.** At tp = 9, which KV head does each of the 9 ranks store? Write a
# list of 9 head numbers, rank 0 first.

# %%
my_heads_per_rank = None  # your answer: a list of 9 KV head numbers
ask("12.kv-head-per-rank", my_heads_per_rank, cfg=cfg)

# %% [markdown]
# Now each size for real: its ranks start as processes (rank 0 here runs the scheduler
# and the cache; ranks 1 .. tp - 1 load the checkpoint and keep their slices), generate 2
# tokens for each of two chat prompts (a prefill step and one decode step), and report
# what one rank stores, how many all-reduces a step took, and whether the tokens equal
# tp = 1's.

# %%
rows = tensor_parallel.run_tp(model, texts.chat_prompts()[:2], [1, 3, 9], TP_TOKENS)
table = pd.DataFrame.from_dict(rows, orient="index")
print(table[["kv_heads_per_rank", "kv_bytes_per_token_per_rank", "all_reduces_per_step",
             "identical_to_tp1"]].to_string())  # fmt: skip
per_rank = [f"tp={tp}: {row['kv_bytes_per_token_per_rank']:,}" for tp, row in rows.items()]
print("KV bytes per token per rank:", ", ".join(per_rank))
print("KV head of each rank at tp=9:",
      [kv_head_range(rank, 9, cfg.num_key_value_heads).start for rank in range(9)])  # fmt: skip

# %%
kv_per_rank_figure(rows, cfg.num_key_value_heads).show()

# %% [markdown]
# Per-rank KV falls from 46,080<!-- out --> bytes per token at tp = 1 to
# 15,360<!-- out --> at tp = 3, and stays there at tp = 9: that is what lets a model
# whose KV does not fit one device's memory serve at all. Each step costs two all-reduces
# per layer (after the attention output projection and after the MLP's down projection):
# 60<!-- out --> per step for 30 layers. On this CPU the ranks share the same two cores,
# so tensor parallelism costs time here (start-up and decode speed below: every rank
# process competes for the cores, and each all-reduce waits for the slowest); on GPUs
# each rank reads only its slice of the weights from its own memory, which is the point.

# %%
# NBVAL_IGNORE_OUTPUT
print(table[["startup_s", "decode_tok_per_s"]].to_string())

# %% [markdown]
# ## 2 · Disaggregated prefill/decode under long-prompt interference
#
# Four chat requests decode 8 tokens each while two long prompts (the first 600
# characters of two doc-QA prompts, ~120 tokens each) arrive among them, 0.25 s apart.
# **Colocated**, each long prefill is a step every running decode waits for (chunked
# prefill splits it into smaller stalls). **Disaggregated**, a second process (one torch
# thread) prefills every prompt; the decode engine (this process, two threads) admits the
# finished KV as it would swap a preempted request back in. The same run is then repeated
# with a *decode pool* of two decode engines behind the one prefill engine (1P:2D, the
# end of this section). The greedy tokens must be the same in all four setups, no KV
# block may stay held on any engine afterwards (the experiment checks every cache), and
# the bytes moved must be exactly the prompts' KV bytes:

# %%
trace = disagg.interference_trace(n_chat=4, n_long=2, chat_tokens=CHAT_TOKENS, long_tokens=4,
                                  gap_s=GAP_S, long_chars=LONG_CHARS)  # fmt: skip
setups = disagg.colocated_vs_disaggregated(model, trace, decode_engines=(1, 2))
pair_row, pool_row = setups["disaggregated"], setups["disaggregated 1P:2D"]
bytes_moved, prompt_tokens = pair_row["bytes_moved"], pair_row["prompt_tokens_moved"]
print({name: row["identical_to_colocated"] for name, row in setups.items()})
print("transfers rejected:", pair_row["transfers_rejected"], pool_row["transfers_rejected"])
print(f"KV bytes moved: {bytes_moved:,} for {prompt_tokens} prompt tokens (1P:2D: "
      f"{pool_row['bytes_moved']:,} for {pool_row['prompt_tokens_moved']})")  # fmt: skip

# %% [markdown]
# Per prompt token, the transfers carry exactly the model's KV: K and V, for every layer
# and KV head, at the cache's dtype (float32 on this CPU). Measured from the transfers and
# computed from the model's config, the two must agree:

# %%
moved_per_token = bytes_moved // prompt_tokens  # measured: what the transfers carried
dtype_bytes = model.hf_model.dtype.itemsize
head_dim = cfg.hidden_size // cfg.num_attention_heads
model_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * dtype_bytes
assert bytes_moved == prompt_tokens * moved_per_token and moved_per_token == model_per_token
assert moved_per_token == rows[1]["kv_bytes_per_token_per_rank"]  # tp = 1's pool agrees
print(f"KV bytes per prompt token moved: {moved_per_token:,} = 2 (K, V) x "
      f"{cfg.num_hidden_layers} layers x {cfg.num_key_value_heads} KV heads x {head_dim} "
      f"dims x {dtype_bytes} bytes")  # fmt: skip

# %% [markdown]
# What the decode side does with a transfer when it arrives: `_route` picks the decode
# engine that takes it (with one decode engine, that one), whose consumer connector
# checks it (its checksum, and exactly the prompt's KV bytes); a bad one is dropped and
# the request recomputed from its prompt, never decoded on bad KV. An intact one brings
# the first token the prefill engine sampled, and the request joins the scheduler as an
# arrival whose KV is already computed: when it fits, the scheduler allocates its blocks
# and the connector loads the KV into them, layer by layer.

# %%
show_source(Disaggregated._admit)

# %% [markdown]
# **Check yourself.** Between two machines those bytes cross a network. How many
# milliseconds would the KV moved above take over a 25 GB/s link (a 200 Gb/s NIC)?
# Compute it from `bytes_moved`.

# %%
my_transfer_ms = None  # your answer: milliseconds, computed from bytes_moved
ask("12.transfer-ms", my_transfer_ms, bytes_moved=bytes_moved)

# %% [markdown]
# The latencies and throughput, measured on this machine (they vary from run to run;
# `prefill steps s` is the wall time of the steps that prefilled in the engines that
# decode, which every running decode waited for):

# %%
# NBVAL_IGNORE_OUTPUT
latency = pd.DataFrame({n: {"ttft p50": r["ttft_s"]["p50"], "itl p50": r["itl_s"]["p50"],
                            "itl p99": r["itl_s"]["p99"], "tok/s": r["tokens_per_s"],
                            "wall s": r["wall_s"], "prefill steps s": r["prefill_steps_s"]}
                        for n, r in setups.items()}).T  # fmt: skip
print(latency.to_string())
co, dis = latency.loc["colocated"], latency.loc["disaggregated"]
print(
    f"disaggregated / colocated: ITL p99 {dis['itl p99'] / co['itl p99']:.2f}x, "
    f"ITL p50 {dis['itl p50'] / co['itl p50']:.2f}x, tok/s {dis['tok/s'] / co['tok/s']:.2f}x"
)
print("load average (1, 5, 15 min) at the end:", os.getloadavg(), "on", os.cpu_count(), "cores")
latency_figure(setups).show()

# %% [markdown]
# What disaggregation is for is the ITL p99 column. Colocated, a decode that shares its
# step with a long prefill waits for the whole prefill (the `prefill steps s` column is
# the time every running decode spent waiting so), and that wait is its tail latency;
# chunked prefill cuts the wait into smaller pieces. Disaggregated, no step of the decode
# engine holds a prefill (0 s), and its ITL p99 falls to 0.76x<!-- out --> of
# colocated's (while its ITL p50 rises: each token now also waits for the transfer
# and the pair's two processes share two cores).
#
# The KV it receives instead has to cross a link. Here is what the measured bytes would
# take at 25 GB/s (a 200 Gb/s NIC) and 100 GB/s (an 800 Gb/s one), next to the prefill
# engine's own measured step time for the same prompts (each step counted once, though
# one step may finish several prompts):

# %%
# NBVAL_IGNORE_OUTPUT
link = pd.DataFrame({"prompt tokens": prompt_tokens, "KV bytes": bytes_moved,
                     "ms at 25 GB/s": disagg.link_ms(bytes_moved, 25),
                     "ms at 100 GB/s": disagg.link_ms(bytes_moved, 100),
                     "prefill ms (measured)": pair_row["prefill_engine_s"] * 1e3,
                     "prefill steps": pair_row["prefill_engine_steps"]},
                    index=["1P:1D"])  # fmt: skip
print(link.round(2).to_string())
ratio = link["prefill ms (measured)"].iloc[0] / link["ms at 25 GB/s"].iloc[0]
print(f"measured prefill / link time at 25 GB/s: {ratio:,.0f}x")

# %% [markdown]
# The link would take under a millisecond (0.86<!-- out --> ms at 25 GB/s), and the
# prefill of the same prompts took seconds on this CPU, thousands of times longer
# (1,751x<!-- out --> in this run): here moving the
# KV is nearly free. On a GPU the same prefill takes milliseconds, and then the link's
# time is no longer small beside it; for larger models the KV per token grows too (vLLM's
# connectors save and load it layer by layer inside the forward, so that each layer's
# transfer overlaps compute).
#
# Throughput is another matter. Here disaggregated's tok/s is 0.60x<!-- out --> of
# colocated's. vLLM's docs say it plainly: "Disaggregated prefill DOES NOT improve
# throughput" ([vLLM: disaggregated prefilling](https://docs.vllm.ai/en/latest/features/disagg_prefill/));
# it buys the tuning of time to first token and inter-token latency separately, and
# control of the tail. On one 2-core machine the ratio measures the machine, not the
# design, and it swings from run to run, above 1 or below, with what else the machine
# runs (the load average printed above counts this notebook's own processes too). The
# pair is two processes, the decode engine on two threads and the prefill engine on a
# thread of its own, against one colocated engine that runs one step at a time. Where
# the colocated engine leaves CPU time idle (between its steps, or in small decode
# steps that two threads do not keep busy), the prefill process uses it and the pair
# finishes sooner; where there is none to find, the prefill process takes its time from
# the decodes and the pair finishes later. Neither says what disaggregation does to
# throughput: that needs the same devices given to both arrangements, such as two
# colocated engines against one prefill and one decode engine, each on devices of its
# own.
#
# ### A decode pool: one prefill engine, two decode engines
#
# One prefill engine can feed several decode engines: a prompt's prefill is one heavy
# step, its decode a long run of light ones, so deployments size the two sides apart (the
# P:D ratio; vLLM's XpYd proxy demo, [`disagg_proxy_demo.py`](https://github.com/vllm-project/vllm/blob/03a7284d692e562eaaf759cce2726df3640e6557/examples/online_serving/disaggregated_serving/disagg_proxy_demo.py),
# fronts X prefill and Y decode instances). `Disaggregated(..., decode_engines=2)` keeps
# one prefill process and gives it two decode engines, each with its own cache and
# scheduler. Each finished prefill goes to the *least-loaded* one: the fewest unfinished
# requests, then the most free KV blocks, then the first. That is the rule of the proxy
# demo's `LoadBalancedScheduler` (fewest requests in flight, the first on a tie) and of
# notebook 14's router, read here off each engine's own queues:

# %%
show_source(least_loaded)

# %% [markdown]
# **Check yourself.** A pool of three decode engines holds (unfinished requests, free KV
# blocks) = (3, 40), (2, 12) and (2, 30). Which engine (0, 1 or 2) takes the next
# prefilled request?

# %%
pool_snapshot = [(3, 40), (2, 12), (2, 30)]  # (unfinished requests, free KV blocks) each
my_engine = None  # your answer: 0, 1 or 2
ask("12.route-next", my_engine, snapshot=pool_snapshot)

# %% [markdown]
# The run above, 1P:1D against 1P:2D on the same trace: the requests each decode engine
# was given, the most sequences it held running after a step, its mean decode batch, and
# the latencies (timings and the split between engines vary from run to run):

# %%
# NBVAL_IGNORE_OUTPUT
pool_table = pd.DataFrame({"1P:1D": pair_row, "1P:2D": pool_row}).T
pool_table["itl p50"] = [r["itl_s"]["p50"] for r in (pair_row, pool_row)]
pool_table["itl p99"] = [r["itl_s"]["p99"] for r in (pair_row, pool_row)]
print(pool_table[["routed", "peak_running", "mean_decode_batch", "itl p50", "itl p99",
                  "tokens_per_s", "wall_s"]].to_string())  # fmt: skip
itl_ratio = pool_row["itl_s"]["p50"] / pair_row["itl_s"]["p50"]
tok_ratio = pool_row["tokens_per_s"] / pair_row["tokens_per_s"]
print(f"1P:2D / 1P:1D: ITL p50 {itl_ratio:.2f}x, tok/s {tok_ratio:.2f}x")
pool_figure(setups).show()

# %% [markdown]
# What changed: the least-loaded policy split the six requests 3 and 3 (the split can
# differ from run to run: it depends on which requests are still running when each
# transfer arrives), each decode engine held at most half the running sequences, and
# each ran about half the decode batch (a mean of 2.12<!-- out --> and 2.43<!-- out -->
# sequences per step, against 2.83<!-- out --> for the single decode engine). On GPUs
# that is what a pool is for: each decode engine's KV memory holds only its share of the
# sequences, so the pool holds more at once, and each engine's step runs on a device of
# its own.
#
# What cannot change here is throughput. Both decode engines run in this process, on the
# same two cores, and take turns to step, so a request waits for both engines' steps
# between two of its tokens; and part of a step's cost (reading the weights, the Python
# around the forward) does not shrink with its batch, so two half-batch steps take
# longer than one full one. In this run 1P:2D's ITL p50 was 1.81x<!-- out --> of 1P:1D's
# and its tok/s 0.93x<!-- out -->: no gain, and on this shared machine the ratios swing
# from run to run. Comparing P:D ratios for speed needs each engine on its own device.
#
# ## 3 · The way on: the same workload on a real vLLM deployment
#
# kvlab's processes teach the mechanism; when a model outgrows one machine, vLLM is what
# runs it. The same workload file replays against any OpenAI-compatible endpoint
# (`kvlab replay`), so the figures above can be set beside a real deployment's:
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
#
# > **Summary.** Tensor parallelism splits a model's heads over ranks: `tp` must divide
# > the query heads, each rank stores the KV of its own KV heads (a third of it here at
# > tp = 3), and past tp = KV heads the heads are replicated, so per-rank KV stops
# > shrinking. Every step pays two all-reduces per layer. Disaggregation prefills on one
# > engine and decodes on another: the prompt's KV (46,080 bytes per token for this
# > model) crosses between them, checked on arrival, and the decode engine never stalls
# > for a long prefill, which is what bounds its tail inter-token latency. It buys
# > latency control, not throughput: on one machine both figures here share two cores.
# > One prefill engine can feed a pool of decode engines (1P:2D), each request routed to
# > the least-loaded one; each engine then runs a smaller batch, which only pays off when
# > each has a device of its own.
#
# ## What to try next
#
# * Set `FULL_SIZE = True`: longer prompts 1 s apart make the colocated stalls longer.
# * `disagg.colocated_vs_disaggregated(model, trace, kv_codec="int8")`: the bytes moved
#   fall to about a quarter; what happens to the tokens?
# * `Disaggregated(model, config, config, fault="corrupt")` spoils every transfer after
#   its checksum: count the rejected transfers and check the tokens are still the same.
# * `disagg.colocated_vs_disaggregated(model, trace, decode_engines=(1, 2, 3))`: how do
#   the requests split over three decode engines, and what happens to each one's batch?
# * Give the colocated engine chunked prefill with a smaller `max_num_batched_tokens`:
#   how close does its ITL p99 come to the disaggregated one?
#
# The stored timings in this notebook come from the machine below (a 2-core CPU unless
# it says otherwise); token counts, bytes and head maps are the same on any machine.

# %%
# NBVAL_IGNORE_OUTPUT
print(f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, cpu")
