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
# # 10 · A KV hierarchy: host and disk tiers, sessions, and a connector named like vLLM's
#
# *Engine files shown here:* `kvlab/cache/tiers/` (`host.py`, `disk.py`, `stack.py`,
# `policies.py`, `connector.py`), `kvlab/cache/connector.py` (the vLLM-named interface),
# `kvlab/cache/paged.py` (`_evict` demotes, `_allocate` promotes), `kvlab/engine/sessions.py`
# (`engine.end_session`, the TTL), `kvlab/multiturn.py` (the multi-turn chat trace),
# `kvlab/experiments/tiers.py`, `kvlab/experiments/tier_decode.py`, `kvlab/viz/tiers.py`.
#
# Notebook 03 kept a finished request's blocks on the device as a **cache**: a later
# request with the same prefix points at them instead of recomputing. But the device pool
# is small, and when it fills, the least recently used cached block is **evicted**, its
# K/V thrown away. In a chat service that is exactly the block the user needs next: they
# come back after a pause, with the whole conversation so far as the prompt.
#
# Production engines keep evicted blocks one level down (vLLM's KV connector and its CPU
# offloading connector, SGLang's HiCache, TensorRT-LLM's secondary memory, LMCache,
# llama.cpp's slot save / restore). This notebook does it on the real model:
#
# 1. one prompt's blocks walked down the hierarchy: device → host → disk, and back;
# 2. what a tier must never do: serve another tenant's block, or a damaged file;
# 3. a multi-turn chat trace more than twice the device pool: recomputed tokens per
#    configuration, and the hierarchy drawn as sessions come and go;
# 4. time to first token by where the history was; copy time per block;
# 5. what offload does to decode: inter-token latency with the KV on the device, streaming
#    back from host, and held in host memory;
# 6. the connector interface, method by method beside vLLM's.
#
# Set-up: one cell picks the device (CUDA if present, else CPU), seeds torch and loads
# the model.

# %%
import os
import platform

import plotly.io as pio
import torch

import kvlab
from kvlab import texts
from kvlab.cache.connector import method_table
from kvlab.cache.tiers import LOAD_POLICIES, WRITE_POLICIES, TierConfig
from kvlab.cache.tiers.host import HostTier
from kvlab.cache.tiers.stack import TierStack
from kvlab.config import SamplingParams
from kvlab.course import ask, show_source
from kvlab.experiments import tier_decode
from kvlab.experiments import tiers as tier_exp
from kvlab.multiturn import chat_sessions
from kvlab.viz import tiers as viz

pio.renderers.default = "plotly_mimetype"
torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
model = kvlab.load_model(device=device, progress=False)
FULL_SIZE = False  # True: the benchmark's 10 sessions x 3 turns (minutes on a 2-core CPU)
ANSWER_TOKENS = 8 if FULL_SIZE else 4  # greedy tokens per answer in sections 1 and 2

# %% [markdown]
# ## 1 · One prompt down the hierarchy and back
#
# An engine with two tiers below its pool: `host` (a bounded LRU of the codec's stored
# bytes in host memory) and `disk` (a bounded directory, one checksummed file per block).
# A tier's key is the prefix index's chained hash of the block (its parent's key, its
# token ids and the salt): the same key the device's hash index uses.

# %%
tiers = TierConfig(tiers=("host", "disk"), host_blocks=64, disk_blocks=256)
config = kvlab.EngineConfig(cache="paged", prefix_caching="hash", block_size=16,
                            kv_budget_tokens=2048, max_model_len=2048, tiers=tiers)  # fmt: skip
engine = kvlab.Engine(model, config)
connector, stack = engine.cache.connector, engine.cache.connector.stack
prompt = f"Here is a document.\n\n{texts.documents()['doc01_library_rules']}\n\nQuestion: "
answer = SamplingParams(max_new_tokens=ANSWER_TOKENS)
first = engine.generate([prompt + texts.questions()[0]], answer)[0]
print("prompt tokens:", len(first.prompt_token_ids), "| answer:", repr(first.text))
print("device cached blocks:", engine.cache.allocator.num_cached, "| tiers:", stack.blocks())

# %% [markdown]
# Evict every cached block now (`offload_cached`, what a full pool would do one block at
# a time): write-back copies each one down to the host tier as it leaves the device.
#
# The host tier is a bounded LRU: an `OrderedDict` whose first entry is the least recently
# used. `put` adds a block at the recent end and `_make_room` pops from the other end
# while the tier holds more than its capacity, returning what it evicted; `get` moves a
# hit to the recent end:

# %%
show_source(HostTier, start="def get(", end="evicted.append(")

# %% [markdown]
# What a tier evicts goes one tier down: `TierStack.save` hands each tier's evictions to
# the next (from the host to the disk; past the last tier they are gone):

# %%
show_source(TierStack.save)

# %% [markdown]
# **Check yourself.** A host tier of 3 blocks sees, in order: put A, put B, put C, get A,
# put D. Which block does the last put send down to the disk tier?

# %%
my_victim = None  # your answer: "A", "B", "C" or "D"
ask("10.lru-victim", my_victim, capacity=3, ops=["put A", "put B", "put C", "get A", "put D"])

# %%
print("moved off the device:", connector.offload_cached(), "| tiers:", stack.blocks())
second = engine.generate([prompt + texts.questions()[1]], answer)[0]
print("hit tokens:", second.metrics.prefix_hit_tokens, "| loaded back per tier:",
      connector.transfers.onloads)  # fmt: skip
print(engine.explain(second.request_id))

# %% [markdown]
# **Check yourself.** Every block that moves between tiers is the codec's stored bytes
# for 16 tokens of every layer. How many bytes does one block of this model move (fp32
# K/V, no codec; the shape is printed below)?

# %%
pool_spec = engine.cache.pool.spec
print(pool_spec, "| dtype", model.dtype, "| block_size", engine.cache.block_size)

# %%
my_block_bytes = None  # your answer: a whole number of bytes
ask("10.block-bytes", my_block_bytes, spec=pool_spec, block_size=16, dtype=model.dtype)

# %% [markdown]
# Down once more, and then from host to disk (`spill`): the next hit reads the files,
# checks each checksum, and loads the codes into fresh device blocks. A file holds the
# block's bytes and a small JSON header.

# %%
connector.offload_cached()
print("spilled to disk:", stack.spill(0), "| tiers:", stack.blocks())
third = engine.generate([prompt + texts.questions()[2]], answer)[0]
print("hit tokens:", third.metrics.prefix_hit_tokens, "| loaded back per tier:",
      connector.transfers.onloads)  # fmt: skip
disk = stack.tier("disk")
print(
    "one file:",
    disk.path(disk.keys()[0]).name[:12] + "…",
    disk.path(disk.keys()[0]).stat().st_size,
    "bytes",
)

# %% [markdown]
# ## 2 · What a tier must never do
#
# **Serve another tenant.** The key includes the salt, so a request under salt `"b"` does
# not even find the keys of the same tokens (no tier is asked: `salt_refusals` stays 0).
# Every entry also remembers its salt and refuses a lookup under another one, a second
# line of defence that `tests/test_tiers.py` exercises with a forced key collision.
#
# **Serve a damaged file.** A disk file is a JSON header (key, salt, shapes, length, a
# BLAKE2b digest) and the raw codes. Flip one byte and the read fails its checksum: the
# file is deleted, counted, and the block recomputed. The answer does not change.

# %%
connector.offload_cached()
stack.spill(0)
salted = kvlab.workloads.Request(prompt + texts.questions()[2], ANSWER_TOKENS, salt="b")
other = engine.run([salted])[0]
print("salt 'b' hit tokens:", other.metrics.prefix_hit_tokens, "| refusals:",
      {t.name: t.stats.salt_refusals for t in stack.tiers})  # fmt: skip
keys = engine.cache.index.keys(third.prompt_token_ids, None)
path = disk.path(keys[3])
data = bytearray(path.read_bytes())
data[len(data) // 2] ^= 0xFF  # one flipped byte in block 3's codes
path.write_bytes(data)
again = engine.generate([prompt + texts.questions()[2]], answer)[0]
print("hit tokens:", again.metrics.prefix_hit_tokens, "(blocks 0-2 from disk, the rest recomputed)")
print("corrupt files detected:", disk.stats.corrupt, "| same answer:", again.text == third.text)
engine.cache.check_integrity()
stack.close()

# %% [markdown]
# ## 3 · A multi-turn chat trace more than twice the device pool
#
# `kvlab.multiturn.chat_sessions` builds conversations from kvlab's texts: a document and
# a question, then another question each turn. `run_sessions` serves them in rounds, two
# turns at a time: between two turns of one user come everyone else's (the pause). Each
# turn's prompt is the previous prompt, the model's actual answer, and the new message.
# Each session ends (`engine.end_session`) after its last turn, freeing its blocks on
# every tier.
#
# Here 3 sessions of 2 turns, 2 new tokens a turn, on a 20-block device pool (`FULL_SIZE`:
# the benchmark's 10 sessions of 3 turns, 16 new tokens, a 64-block pool). The same trace
# runs through five configurations (the policies are registered parts):

# %%
for registry in (WRITE_POLICIES, LOAD_POLICIES):
    for name, policy in registry.items():
        print(f"{name:18} {policy.describe}")

# %%
n, turns, pool, new = (10, 3, 1024, 16) if FULL_SIZE else (3, 2, 320, 2)
sessions = chat_sessions(n, turns, max_doc_chars=2500 if FULL_SIZE else 1200)
trace = tier_exp.compare_tiering(model, sessions, pool_tokens=pool, max_new_tokens=new,
                                 end_after=True, observe="host+disk",
                                 every=3 if FULL_SIZE else 2)  # fmt: skip
print(f"{trace['sessions']} sessions, {trace['turns']} turns; device pool {trace['pool_blocks']} "
      f"blocks; working set {trace['working_set_blocks']} blocks "
      f"({trace['working_set_over_pool']:.1f}x the pool)")  # fmt: skip
tier_exp.policy_table(trace)

# %% [markdown]
# Every configuration gives the same greedy tokens for every turn (`identical`), and the
# tiers recompute a fraction of what device-only caching does: device-only has evicted a
# user's conversation by the time they come back. Here device-only recomputes
# 1387<!-- out --> prompt tokens and every tier configuration 763<!-- out -->, a reduction
# of 0.45<!-- out -->, on a working set 2.2x<!-- out --> the device pool. The counts do
# not depend on the machine.

# %%
viz.recompute_figure(trace)

# %% [markdown]
# The hierarchy of the `host+disk` run, drawn every two steps (`FULL_SIZE`: three): move
# the slider. Each square is a block, coloured by the session whose conversation it
# holds. Blocks flow from the device down to host and disk as other users' turns push
# them out, come back up when their user returns, and vanish from every tier when the
# session ends.

# %%
viz.hierarchy_figure(trace["frames"])

# %% [markdown]
# ## 4 · Time to first token by tier, and copy time per block
#
# A follow-up turn on the shortest session's opening (its blocks on the device, in the host
# tier, on disk, or nowhere), each request alone, median of three. On this CPU machine "device"
# and "host" are both RAM, so a host hit costs a memory copy; a disk hit adds a file read
# and a checksum (the file may sit in the OS page cache). These are timings of one machine
# at one moment: each cell prints the load average (runnable processes) beside its
# 2 cores; where it is well above 2, other work shared the cores and the figures are
# inflated and noisy (even out of order). The token counts never are.

# %%
# NBVAL_IGNORE_OUTPUT
shortest = min(sessions, key=lambda s: len(s.messages[0]))
ttft = tier_exp.ttft_by_tier(model, shortest, texts.questions()[:3])
print("hit tokens by tier:", ttft["hit_tokens"])
print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
viz.ttft_figure(ttft)

# %%
# NBVAL_IGNORE_OUTPUT
copy = tier_exp.copy_times(model)
print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
print(
    f"one block = {copy['block_tokens']} tokens = {copy['block_bytes']:,} bytes ({copy['device']})"
)
for what, seconds in copy["median_s"].items():
    print(f"  {what:15} {seconds * 1e6:8.0f} µs per block (measured here)")
for gb_s in (25, 64):
    print(f"  WHAT-IF, not measured: a {gb_s} GB/s link moves it in "
          f"{tier_exp.project_copy(copy['block_bytes'], gb_s) * 1e6:.0f} µs")  # fmt: skip

# %% [markdown]
# ## 5 · What offload does to decode: inter-token latency
#
# Section 4 timed the first token. Offload also reaches decode: a request whose history
# comes back from host memory arrives while others decode, and the step that loads its
# blocks is a step every running request waits for. Some designs go further and keep the
# KV in host memory for good, reading it across the link at every step.
#
# `kvlab/experiments/tier_decode.py` decodes the same four requests (a document and a
# question each, one arriving every two steps, 8 greedy tokens each) on one engine in
# three cases, and times every step from outside `engine.step()`, so scheduling, loads and
# copies are inside the inter-token latency (ITL):
#
# * **device**: every prompt's blocks sit cached on the device pool (the baseline);
# * **streamed from host**: the same blocks were offloaded to the host tier first; the
#   step that admits a request loads its blocks back into device blocks
#   (`TierConnector.promote`), synchronously, while the others decode. vLLM's CPU
#   offloading loads into GPU blocks too: `--kv-offloading-size` (GiB of host memory,
#   [`CacheConfig.kv_offloading_size`](https://github.com/vllm-project/vllm/blob/main/vllm/config/cache.py))
#   turns on its [`OffloadingConnector`](https://github.com/vllm-project/vllm/blob/main/vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py),
#   whose scheduler side answers that the hit tokens [will be loaded asynchronously,
#   between scheduler steps](https://github.com/vllm-project/vllm/blob/main/vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py)
#   (`get_num_new_matched_tokens` returns `True`): the arriving request waits for its
#   blocks while the running ones go on decoding, where kvlab's step waits for the load;
# * **held in host**: no mode of kvlab's engine but an experiment, `HostResident`: between
#   steps a running request's K/V lives only in host memory. Before each step every block
#   of every running request is copied in; after it, the blocks the step wrote are copied
#   out and the device copies are overwritten with NaN (not timed), so a right token proves
#   the step read what was copied in. (A request's prefix is still found on the device
#   when it is admitted, as in the baseline.)
#
# On this CPU machine "device" and "host" are the same RAM: what the measurement adds is
# a gather and a memory copy per block, not a PCIe transfer. The copy in, every step:

# %%
show_source(tier_decode.HostResident.load)

# %% [markdown]
# In every case the step in which a request arrives also runs its prompt's last tokens
# beside the decodes (chunked prefill), so the table compares arrival steps with arrival
# steps; the streamed case's other steps carry no load at all.

# %%
# NBVAL_IGNORE_OUTPUT
docs = texts.documents()
decode_docs = ["doc05_baking_bread", "doc06_beekeeping_basics", "doc07_clouds_and_weather",
               "doc08_remote_work_policy"]  # fmt: skip
decode_prompts = [f"Here is a document.\n\n{docs[name][:1000]}\n\nQuestion: {question}"
                  for name, question in zip(decode_docs, texts.questions())]  # fmt: skip
decode_setup = tier_decode.DecodeSetup(new_tokens=8, stagger=2)
itl = tier_decode.decode_itl(model, decode_prompts, decode_setup)
print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
print(f"held in host: {itl['copy_ms_per_step']:.1f} ms of copying per decode step (measured here)")
tier_decode.itl_table(itl)

# %%
print("prompt tokens:", itl["prompt_tokens"])
print("identical greedy tokens in all three cases:", itl["identical"])
print("streamed: blocks loaded back from the host tier:", itl["loaded_blocks"])
per_step = itl["bytes_per_step"]
print(f"held in host: {per_step:,} bytes = {per_step // itl['block_bytes']} blocks copied per "
      "decode step (median)")  # fmt: skip

# %%
# NBVAL_IGNORE_OUTPUT
viz.itl_figure(itl)

# %% [markdown]
# The tokens are the same in every case; what differs is when the bytes move. Streaming
# back loads 60<!-- out --> blocks in all, each once, in the step its request arrives:
# that step costs about what section 4's host-to-device copy per block costs, times the
# request's blocks, and the steps after it are device steps again. Holding the KV in host
# memory moves the whole context of every running request at every step: in the median
# step 26,542,080<!-- out --> bytes here (in and out), growing with the context.
#
# **Check yourself.** The held case copies the blocks printed above at every step. How
# many microseconds would a 25 GB/s link take to move them (bandwidth only)?

# %%
my_copy_us = None  # your answer: microseconds per step
ask("10.copy-time", my_copy_us, blocks=per_step // itl["block_bytes"],
    block_bytes=itl["block_bytes"], link_gb_s=25)  # fmt: skip

# %%
for gb_s, seconds in itl["projection_s"].items():
    print(f"WHAT-IF, not measured: a {gb_s} GB/s link moves them in {seconds * 1e6:.0f} µs")

# %% [markdown]
# Over a real link that is a projection, not a measurement: 1062<!-- out --> µs a step
# at 25 GB/s, 265<!-- out --> µs at 100 GB/s, paid at every step; a tier pays the link
# once per block that comes back.

# %% [markdown]
# ## 6 · The connector, beside vLLM's
#
# `kvlab/cache/connector.py` keeps vLLM's method names (its
# `vllm/distributed/kv_transfer/kv_connector/v1/base.py`). The scheduler side asks how many
# tokens the tiers can add to a device hit, then records the blocks it allocated for them;
# the worker side loads them (per layer in vLLM, overlapped with compute) and saves.

# %%
engine = kvlab.Engine(model, config)
connector = engine.cache.connector
engine.generate([prompt + texts.questions()[0]], SamplingParams(max_new_tokens=4))
connector.offload_cached()
seq = engine.make_sequence(prompt + texts.questions()[1])
print("get_num_new_matched_tokens ->", connector.get_num_new_matched_tokens(seq, 0))
for side, name, doc in method_table(connector):
    print(f"{side:9} {name:27} {doc}")
connector.stack.close()

# %% [markdown]
# > **Summary.**
# > * Below the device pool, tiers keep evicted blocks: host memory (a bounded LRU) and
# >   disk (checksummed files), keyed by the prefix index's chained block hash, salt
# >   included.
# > * Write-back copies a block down when the device evicts it; a later request that
# >   matches the prefix loads it back instead of recomputing it, with identical tokens.
# > * A tier never serves another salt's block or a damaged file: it recomputes instead.
# > * On a multi-turn chat trace larger than the pool, tiers cut the recomputed prompt
# >   tokens; what a hit costs is a copy (host) or a file read (disk), against a prefill.
# > * Streaming blocks back from host costs the decode steps in which they load; KV held
# >   in host memory costs a copy of the whole context at every step (same tokens in both).
#
# ## What to try next
#
# * Set `FULL_SIZE = True`: ten sessions, a 1,024-token pool, the benchmark's trace
#   (`python benchmarks/kv_tiers.py` prints the same figures as JSON).
# * Shrink `host_blocks` to a few blocks in `tier_exp.tier_configs`: the disk tier serves
#   more, and `policy_table` shows its hits climb.
# * Run the trace with `kv_codec="int8"`: blocks move as stored codes, a quarter of the
#   bytes (`copy_times(model, kv_codec="int8")`).
# * Give every session its own salt (`ChatSession(..., salt=...)`): nothing is shared,
#   and the tiers still serve each user their own history.
# * Set `EngineConfig(session_ttl_s=...)` instead of ending sessions by hand.
# * Give `tier_decode.decode_itl` longer documents (`[:2000]`) or more requests
#   (`DecodeSetup(stagger=1)`): the held case's bytes per step grow with the context, the
#   streamed case's loads do not recur.
#
# The stored timings in this notebook come from the machine below (a 2-core CPU unless
# it says otherwise); token and block counts are the same on any machine.

# %%
# NBVAL_IGNORE_OUTPUT
print(f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, {device}")
