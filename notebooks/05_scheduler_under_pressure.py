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
# # 05 · The scheduler under pressure
#
# *Engine files shown here:* `kvlab/engine/scheduler.py` (preemption, swap, chunked prefill),
# `kvlab/cache/admission.py` (watermark admission), `kvlab/cache/paged.py` (swap
# out/in), `kvlab/experiments/stress.py`.
#
# *Lesson plan (50 min):* sections 1-4 (preemption: the burst, the run request by request,
# what a preemption costs, the explorer) with their two "check yourself" cells. Sections 5
# and 6 (static against continuous batching, chunked prefill) are **Further**: a second
# lesson, or reading for the learner's own time.
#
# The paged cache of notebook 02 hands out KV blocks as tokens are written. That is what
# lets a server admit more requests than it could hold at their worst case, and it is
# also what can go wrong: a burst of long requests is admitted, they all keep growing,
# and in the middle of decoding **the free list is empty**. A server that over-admits
# without a plan stalls, crashes, or kills requests users have already waited for. A
# paged engine instead **preempts** a victim: it takes its blocks away, either
#
# * by **recompute**: drop them and put the request back in the queue; on resume its
#   prompt *and* the tokens it had generated are prefilled again, or
# * by **swap**: copy its blocks to host memory and, on resume, copy them back into
#   fresh blocks,
#
# and the victim continues exactly where it stopped. The user sees a brief stall, not an
# error. This notebook runs that stress case live on the real model and measures what a
# preemption costs; its Further part then looks at two scheduling choices around it:
# continuous against static batching, and chunked prefill.
#
# Set-up: one cell picks the device (CUDA if present, else CPU), seeds torch and loads
# the model. `FULL_SIZE = True` runs the larger workloads: 32 tokens per request in the
# burst instead of 8, victims up to 512 tokens instead of 256, 16 mixed requests instead
# of 8 with long answers of 48 tokens instead of 16 (short ones 4 instead of 2), a
# 768-token prompt instead of 384, and 24 tokens per request in the explorer instead of 8
# (about a minute more on a CPU).

# %%
import os
import platform

import pandas as pd
import plotly.io as pio
import torch

import kvlab
from kvlab import texts, workloads
from kvlab.cache.admission import WatermarkAdmission
from kvlab.cache.spec import KVSpec
from kvlab.course import ask, show_source
from kvlab.engine.scheduler import Scheduler, victim_key
from kvlab.experiments import stress
from kvlab.viz.scheduler import (
    StressExplorer,
    cost_figure,
    gantt_figure,
    gaps_figure,
    pressure_figure,
)

pio.renderers.default = "plotly_mimetype"
torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
model = kvlab.load_model(device=device, progress=False)
FULL_SIZE = False  # True: longer answers, victims and prompt (the sizes listed above)
BURST_TOKENS = 32 if FULL_SIZE else 8  # section 1: tokens per request of the burst
VICTIMS = [32, 128, 256, 512] if FULL_SIZE else [32, 128, 256]  # section 3: victim lengths
ANSWERS = [4, 4, 4, 48] if FULL_SIZE else [2, 2, 2, 16]  # section 5: short, short, short, long
MIXED = 16 if FULL_SIZE else 8  # section 5: requests
LONG_PROMPT, STREAM_TOKENS = (768, 40) if FULL_SIZE else (384, 24)  # section 6
EXPLORER = dict(budget_tokens=128 if FULL_SIZE else 96, max_new_tokens=24 if FULL_SIZE else 8)

# %% [markdown]
# ## 1 · A burst that does not fit
#
# Eight chat requests arrive at once, each asking for 8 tokens (`ignore_eos=True`, so
# every request produces exactly that many and every count below is the same on every
# run). First they are served with plenty of memory: that run is the reference.

# %%
requests = stress.burst(8, max_new_tokens=BURST_TOKENS)
calm, calm_outputs = stress.serve_burst(model, requests)
demand = stress.kv_demand(calm, requests)
budget = stress.oversubscribed_budget(demand, factor=4, block_size=8)
print(f"KV demand of the burst: {demand} token slots (prompt + {BURST_TOKENS} new, summed)")
print(f"budget for 4x oversubscription: {budget} slots = {budget // 8} blocks of 8 tokens")
longest = max(len(o.prompt_token_ids) for o in calm_outputs) + BURST_TOKENS
print(f"one request at its longest: {longest}")

# %% [markdown]
# Now the same burst with a quarter of that memory. The paged cache admits by
# `admission="watermark"` (its default): a request is admitted as soon as the blocks for
# its first step's tokens are free (here its whole prompt; with chunked prefill, its first
# chunk), and nothing is set aside for the tokens it will generate. The `watermark` is a
# fraction of the pool kept free at admission, for running requests to grow into; kvlab's
# default is **0**: nothing is held back. The whole policy:

# %%
show_source(WatermarkAdmission)

# %% [markdown]
# The name comes from vLLM V0, which kept 1% of the blocks free
# ([vLLM #11](https://github.com/vllm-project/vllm/pull/11)). vLLM V1 admits a waiting
# request when `KVCacheManager.allocate_slots` finds free blocks for its prompt
# ([scheduler.py](https://github.com/vllm-project/vllm/blob/main/vllm/v1/core/sched/scheduler.py),
# the waiting loop of `schedule`; by default it checks the whole prompt even when the
# prompt will be prefilled in chunks, `scheduler_reserve_full_isl`), and its `--watermark`
# option ([vLLM #44594](https://github.com/vllm-project/vllm/pull/44594)) is 0 by default,
# as kvlab's. Either way, requests start early, grow, and run out of blocks mid-decode.
#
# Then the scheduler must take blocks from someone. Before a step runs, `_secure_blocks`
# gives each row of the batch the blocks its new tokens need; while there are not enough
# free, it preempts a **victim**: the running request with the largest `victim_key`, that
# is the lowest priority, and among equals the one admitted most recently (so the oldest
# keeps progressing, and a request may even have to preempt itself):

# %%
show_source(victim_key)

# %%
show_source(Scheduler._secure_blocks)

# %% [markdown]
# **Check yourself.** Blocks ran out while these requests were running, listed as
# (request id, priority, admission order); a higher priority number is more important.
# Which request does the scheduler preempt first? Write its id.

# %%
running_now = [(0, 0, 1), (3, 1, 2), (5, 0, 3), (2, 0, 4), (6, 1, 5)]
my_victim = None  # the request id
ask("05.victim", my_victim, running=running_now)

# %% [markdown]
# The burst, once in each mode:

# %%
runs = {
    mode: stress.serve_burst(model, requests, budget, preemption=mode, block_size=8)
    for mode in ("recompute", "swap")
}
expected = [o.token_ids for o in calm_outputs]
table = pd.DataFrame(
    {mode: stress.burst_summary(engine, outputs) for mode, (engine, outputs) in runs.items()}
)
print(table.to_string())
for mode, (_, outputs) in runs.items():
    print(
        f"{mode:9}: outputs equal the unpressured run: {[o.token_ids for o in outputs] == expected}"
    )
    print(f"{'':9}  preemptions per request: {[o.metrics.preemptions for o in outputs]}")

# %% [markdown]
# Every request completed, none errored, the outputs are token-for-token those of the
# unpressured run, and every block is free again at the end: in both modes. The price is
# in the middle rows: preemptions, and either tokens prefilled a second time (recompute)
# or bytes copied out to host memory and back (swap).
#
# ## 2 · The run, request by request
#
# One row per request, one bar per state it was in, against engine steps (so the
# figure is the same on every machine): **waiting** in the queue, **running** (its KV in
# the cache), **preempted** (blocks dropped, waiting to be recomputed) or **swapped**
# (blocks in host memory). Below it, the free blocks after every step; an ✕ marks each
# preemption, at the free blocks the scheduler had left when it chose a victim (hover
# for who it was).

# %%
pressure_figure(runs["recompute"][0], title="recompute: every request, step by step").show()

# %%
pressure_figure(runs["swap"][0], title="swap: every request, step by step").show()

# %% [markdown]
# What a preemption means to the user is a stall: the time between being preempted and
# running again. Seconds, so this table is this machine's:

# %%
# NBVAL_IGNORE_OUTPUT
stalls = pd.DataFrame(
    {
        mode: engine.request_stats().set_index("request_id")["stall_s"]
        for mode, (engine, _) in runs.items()
    }
)
print(stalls.round(2).to_string())

# %% [markdown]
# ## 3 · What one preemption costs, by victim length
#
# Swap copies the victim's KV out and back: bytes proportional to its length, moved at
# memory-copy speed. Recompute moves nothing but runs the victim's whole sequence through
# the model again: a prefill of its length. `stress.preemption_cost` preempts one victim
# of each length (the first tokens of a held-out text) three times, and times the copies
# and the step that resumes it. The counts first (of the first preemption):

# %%
text_ids = model.tokenizer.encode(texts.heldout())
costs = pd.concat(
    [
        stress.preemption_cost(model, text_ids, VICTIMS, mode, repeats=3)
        for mode in ("swap", "recompute")
    ]
)
by_mode = {mode: rows.set_index("victim_tokens") for mode, rows in costs.groupby("mode")}
moved = pd.DataFrame(
    {
        "bytes swapped out": by_mode["swap"]["bytes_swapped"],
        "MiB": (by_mode["swap"]["bytes_swapped"] / 2**20).round(1),
        "tokens recomputed": by_mode["recompute"]["tokens_recomputed"],
    }
)
print(f"KV bytes per token: {calm.cache.pool.bytes_per_token}")
print(moved.to_string())

# %% [markdown]
# and the times, medians of 3 preemptions of each victim. For swap the preemption adds
# two copies, timed on their own: `preempt_s` (out) and `copy_in_s` (back, before the
# resume step's forward). For recompute it adds the prefill inside the resume step:
# `resume_step_s - decode_step_s`. `decode_spread_s` is how much the plain decode steps
# varied by themselves, the yardstick for noise. (An earlier version of this table took
# swap's extra as a difference of step times too, and printed negative "extra" times:
# a copy of a few milliseconds is smaller than the steps' own variation.)

# %%
# NBVAL_IGNORE_OUTPUT
columns = ["mode", "victim_tokens", "preempt_s", "copy_in_s", "resume_step_s", "decode_step_s",
           "decode_spread_s", "extra_s"]  # fmt: skip
print(
    (costs[columns].set_index(["mode", "victim_tokens"]) * 1e3)
    .round(1)
    .add_suffix(" (ms)")
    .to_string()
)
cost_figure(costs).show()

# %% [markdown]
# On a CPU "host memory" is the same memory, so swap costs two memcpys and recompute a
# prefill: swap wins by far (tens of times at the longest victim here), and for short
# victims its copies sit below the decode steps' own spread. On a GPU server the picture
# changes in scale. The swap goes over PCIe (about 25 GB/s for PCIe 4.0 x16, 50 for 5.0),
# while the prefill that recompute runs instead is compute-bound, about 2 FLOP per
# parameter per token.
#
# **Check yourself.** Llama-3-8B (32 layers, 8 KV heads of 128, bf16 KV) is serving a
# 1,000-token victim. How many milliseconds does swapping it out to host memory and back
# in take at 25 GB/s? Write a line of Python (`llama3_8b.bytes_per_token(torch.bfloat16)`
# gives the bytes per token).

# %%
llama3_8b = KVSpec(num_layers=32, num_kv_heads=8, head_dim=128)
victim_tokens, pcie_gb_s = 1000, 25.0
my_swap_ms = None  # your answer in ms, or a line of Python computing it
ask("05.swap-ms", my_swap_ms, spec=llama3_8b, victim_tokens=victim_tokens, pcie_gb_s=pcie_gb_s)

# %% [markdown]
# Against the prefill, with round figures you can change (an H100 at about 40% of its
# 989 dense bf16 TFLOP/s; Llama-3-8B has 8.0e9 parameters):

# %%
params, gpu_tflops = 8.0e9, 400
prefill_ms = 2 * params * victim_tokens / (gpu_tflops * 1e12) * 1e3
for gb_s in (25, 50):
    swap_ms = 2 * victim_tokens * llama3_8b.bytes_per_token(torch.bfloat16) / (gb_s * 1e9) * 1e3
    print(f"swap out + in at {gb_s} GB/s: {swap_ms:.1f} ms; "
          f"recompute (prefill {victim_tokens} tokens): {prefill_ms:.0f} ms")  # fmt: skip

# %% [markdown]
# Swapping the victim out and back takes 10.5<!-- out --> ms at 25 GB/s (5.2<!-- out -->
# at 50) against 40<!-- out --> ms for its prefill: a few times less device time (both
# grow with its length), so swap is *not* the expensive option on a GPU either.
# Recompute's case is elsewhere: it needs no host memory and no copies to schedule, and
# preemption should be rare. The vLLM paper measured both
# ([Kwon et al., SOSP 2023, sec. 7.3 and fig. 19](https://arxiv.org/abs/2309.06180)): swap
# suffers at small block sizes (many small PCIe transfers), and at block sizes 16-64 the
# two are comparable end to end. vLLM V1 keeps only recompute: its scheduler's
# `_preempt_request` frees the victim's blocks, sets `num_computed_tokens = 0` and puts
# it back at the front of the waiting queue
# ([scheduler.py](https://github.com/vllm-project/vllm/blob/main/vllm/v1/core/sched/scheduler.py));
# it has no swap preemption at all (V0 had both, as kvlab's `preemption=` does).
#
# ## 4 · Try it: the stress explorer
#
# Pick a KV budget (token slots), a burst size and a preemption policy: the widget
# serves that burst live (8 tokens per request, blocks of 8) and redraws the requests and
# the free list. Start tight and give it more memory until the preemptions stop; switch
# policy and watch red (recompute) bars turn orange (swap). (A few seconds per change on
# a laptop CPU.)

# %%
# NBVAL_IGNORE_OUTPUT
StressExplorer(model, burst=6, policy="recompute", **EXPLORER)

# %% [markdown]
# # Further: batching and chunked prefill
#
# *Optional in a 50-minute lesson.* Two scheduling choices that shape every step, with
# or without memory pressure.
#
# ## 5 · Static vs continuous batching
#
# The scheduler runs at most `max_num_seqs=4` requests at a time. Eight chat requests
# arrive together with mixed output lengths: three short answers (2 tokens) for every
# long one (16 tokens). **Static** batching starts a new batch only when the whole
# previous one has finished, so the short answers' seats stay empty while the long one
# finishes. **Continuous** batching fills a seat as soon as it is free.

# %%
mixed = stress.alternating(workloads.uniform_chat(MIXED), ANSWERS)
batching = {
    b: stress.serve_batching(model, mixed, b, max_num_seqs=4) for b in ("static", "continuous")
}
for b, (_, result) in batching.items():
    print(f"{b:10}: {result['output_tokens']} tokens in {result['steps']} steps")

# %%
for b, (engine, _) in batching.items():
    gantt_figure(engine, title=f"{b} batching, max_num_seqs=4").show()

# %% [markdown]
# Same tokens, far fewer steps. In seconds, with time-to-first-token (TTFT), time per
# output token (TPOT) and end-to-end latency percentiles over the 8 requests:

# %%
# NBVAL_IGNORE_OUTPUT
summary = pd.DataFrame(
    {
        b: pd.concat([pd.Series(result), stress.percentiles(engine.request_stats())])
        for b, (engine, result) in batching.items()
    }
)
print(summary.round(3).to_string())
ratio = batching["continuous"][1]["tokens_per_s"] / batching["static"][1]["tokens_per_s"]
print(f"continuous / static throughput: {ratio:.2f}x")

# %% [markdown]
# The step counts are exact; the seconds are this machine's, at its load when the
# cell ran (printed at the end of the notebook). The gain in time (the throughput ratio
# above) is smaller than the gain in steps: on a CPU a decode step of four sequences
# costs more than one of a single sequence (the arithmetic grows with the batch), so
# static batching's emptier steps are also cheaper; and on a shared CPU any step can be
# stretched by other work, so on a busy run the time ratio is mostly noise. On a GPU a
# decode step is bound by reading the weights and the KV, and costs nearly the same for
# 1 or 4 sequences: there the time ratio approaches the step ratio. Static batching's
# clearest loss is TTFT (the `ttft_s` rows): a request that misses a batch waits for the
# whole batch to finish.

# %% [markdown]
# ## 6 · Chunked prefill: keeping the decode streams flowing
#
# Four requests are decoding when a 384-token prompt arrives. Without chunking, its
# prefill is one step of its own, and nobody else gets a token until it is over. With
# `chunked_prefill=True` and `schedule_order="decode-first"`, every step first gives each
# running stream its one decode token, then fills the rest of its token budget
# (`max_num_batched_tokens=64`) with the next chunk of the prompt.

# %%
long_prompt = text_ids[:LONG_PROMPT]
streams = texts.chat_prompts()[:4]
base = dict(cache="paged", max_model_len=1024, kv_budget_tokens=4096)
configs = {
    "whole prompt": kvlab.EngineConfig(**base),
    "chunked, decode-first": kvlab.EngineConfig(
        **base, chunked_prefill=True, schedule_order="decode-first", max_num_batched_tokens=64
    ),
}
arrivals = {
    name: stress.long_prompt_arrives(model, config, streams, long_prompt, STREAM_TOKENS)
    for name, config in configs.items()
}
for name, engine in arrivals.items():
    stats = engine.stats()
    print(
        f"{name:22}: steps by phase {stats['phase'].value_counts().to_dict()}, "
        f"largest step {stats['tokens'].max()} tokens"
    )

# %% [markdown]
# The streams' time between tokens, step after step (seconds: this machine's). Without
# chunking there is one long gap, the whole prefill; with it, a run of somewhat slower
# steps (each carries a 64-token chunk beside the decodes) and no stall:

# %%
# NBVAL_IGNORE_OUTPUT
gaps = {name: stress.decode_gaps(engine.stats()) for name, engine in arrivals.items()}
rows = {}
for name, engine in arrivals.items():
    g = gaps[name]["gap_s"]
    streams_tpot = engine.request_stats().set_index("request_id").loc[range(4), "tpot_s"]
    rows[name] = {
        "p50 ms": 1e3 * g.quantile(0.5),
        "p95 ms": 1e3 * g.quantile(0.95),
        "max ms": 1e3 * g.max(),
        "mean stream TPOT ms": 1e3 * streams_tpot.mean(),
    }
print(pd.DataFrame(rows).round(1).to_string())
gaps_figure(gaps).show()

# %% [markdown]
# Chunking does not make the prompt cheaper (on a CPU the chunks usually cost a little
# more in total: each re-reads the prompt's KV so far); it bounds the worst gap a
# running stream sees, from a whole prefill to one chunk.

# %% [markdown]
# > **Summary.**
# > * Watermark admission (the paged default) admits a request once its first step's
# >   blocks are free, reserving nothing for its answer; kvlab's watermark, the share of
# >   the pool kept free at admission, is 0 by default, as vLLM's `--watermark`.
# > * When blocks run out, the scheduler preempts the running request of lowest
# >   priority, then the most recently admitted, by **recompute** (drop its KV, prefill
# >   it again later) or **swap** (copy its KV to host memory and back). Either way every
# >   request completes with the same tokens as an unpressured run.
# > * Swap moves bytes, recompute redoes a prefill: on a GPU swapping out and back costs
# >   less device time than the prefill, yet the two are comparable end to end at
# >   vLLM's block sizes, and vLLM V1 preempts by recompute only.
# > * Further: continuous batching refills a seat the step after it frees; chunked
# >   prefill bounds the gap a long prompt puts between a running stream's tokens.
#
# ## What to try next
#
# * In the explorer, find the smallest budget at which no request is preempted: how does
#   it compare with the burst's demand, and with the `reserve` admission of notebook 02?
# * Give one request of the burst `priority=1` (`kvlab.workloads.Request(..., priority=1)`)
#   and serve it with `stress.serve_burst`: it is admitted first and chosen as a victim
#   only when it is the last request left to preempt (when it must preempt itself).
# * Re-run section 6 with `schedule_order="prefill-first"`: with a 64-token budget the
#   prompt chunk takes it all and the decodes wait again; then try
#   `max_num_batched_tokens=128` or 256 and watch the trade-off between gap and steps.
# * Cancel a request mid-decode (`engine.cancel(request_id)`) and check
#   `engine.cache.num_available` before and after.
#
# The stored timings and figures in this notebook come from the machine below (a 2-core
# CPU unless it says otherwise), with its load average when the run ended; yours will
# differ in scale, not in shape. Everything printed outside the timed cells is counted in
# tokens, steps, blocks or bytes and is the same on every machine.

# %%
# NBVAL_IGNORE_OUTPUT
machine = platform.processor() or platform.machine()
print(f"{machine}, {os.cpu_count()} cores, torch on {torch.get_num_threads()} threads, {device}")
print("load average (1, 5, 15 min):", ", ".join(f"{x:.2f}" for x in os.getloadavg()))
