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
# # 14 · Many replicas: KV events, vLLM's block hashes, cache-aware routing
#
# *Files shown here:* `kvlab/cache/prefix/hash.py` (vLLM's `sha256_cbor` block hashes),
# `kvlab/cache/events.py` and `kvlab/serve/kv_events.py` (what the cache stores and
# removes, published over ZMQ as vLLM does), `kvlab/route/` (the router: `index.py`,
# `policies.py`, `events.py`, `app.py`), `kvlab/viz/replicas.py`. The design page is
# `docs/design/replicas.md`.
#
# One engine's prefix cache pays off when a request finds its prefix there. With several
# replicas behind a load balancer it pays off only if the balancer sends the request to
# **the replica that holds its prefix**. A multi-turn chat is the plain case: turn 3 of a
# conversation repeats turns 1 and 2 word for word, and only one replica computed them.
#
# How does a router know what each replica holds? vLLM's engines tell it: with
# `--kv-events-config` each publishes a `BlockStored` event (the blocks' chained hashes and
# token ids) whenever blocks become reusable, and `BlockRemoved` when it evicts one. llm-d's
# *precise* scorer and NVIDIA Dynamo's KV router keep a *block hash -> replicas* index from
# these events; when a request comes, they hash its tokens the way the engines do and find
# the replica with the longest cached prefix. For that the hashes must be reproducible
# outside the engine: vLLM's `--prefix-caching-hash-algo sha256_cbor`, which kvlab's hash
# index now computes bit for bit (`prefix_caching_hash_algo="sha256_cbor"`).
#
# This notebook, over real HTTP and real ZMQ, on the real model:
#
# 1. three replicas and a router: the block-hash index as the router sees it;
# 2. where requests go and why, live, under the precise policy;
# 3. the same chats under four policies: prefix hit rate and time to first token;
# 4. what breaks when replicas disagree on block size or hash seed.
#
# Set-up: one cell picks the device (CUDA if present, else CPU), seeds torch and loads
# the model. `FULL_SIZE = True` runs 10 sessions with 32-token answers, documents twice
# as long on replicas with twice the KV, and compares all four policies in section 3
# (the default compares three: least-loaded spreads conversations as round-robin does).

# %%
import platform

import plotly.graph_objects as go
import plotly.io as pio
import torch
from IPython.display import display

import kvlab
from kvlab.cache.prefix.hash import block_hashes
from kvlab.config import EngineConfig
from kvlab.course import ask, show_source
from kvlab.model.prompts import encode_messages
from kvlab.multiturn import SYSTEM
from kvlab.route.index import BlockIndex
from kvlab.route.policies import Policy
from kvlab.route.sessions import summary, tenant_sessions
from kvlab.viz import replicas as viz

pio.renderers.default = "plotly_mimetype"
torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
model = kvlab.load_model(device=device, progress=False)
FULL_SIZE = False  # True: 10 sessions of 3 turns, 32-token answers (minutes on 2 cores)
SESSIONS, MAX_TOKENS = (10, 32) if FULL_SIZE else (5, 4)  # not a multiple of 3 replicas
# Each session's document, and each replica's KV (its working set stays 1-3 replicas' KV)
DOC_CHARS, KV_TOKENS = (1200, 1024) if FULL_SIZE else (600, 512)
COMPARED = viz.POLICY_ORDER[:3] if FULL_SIZE else ["round-robin", "approx-prefix"]

# %% [markdown]
# ## 1 · Three replicas, one router, and what the router knows
#
# `ThreadFleet` starts three replicas as `kvlab serve` runs them (an engine, its loop
# thread, an HTTP server on a free port), each with **512 tokens of KV** and publishing
# its KV events on free ports, and kvlab's router (`kvlab route`) in front, subscribed to
# all three. Everything is in this process so it starts in seconds; `kvlab route` and
# `benchmarks/replicas.py` run the same parts as separate processes.
#
# The workload: chat sessions of 3 turns, each opening with a document (600 characters,
# ~150 tokens) and a question, each later turn one more question; two tenants, each its own
# `cache_salt`. Its working set is ~1,000 tokens: more than one replica holds, less
# than three. (5 sessions, not 6: with a multiple of 3, round-robin would send every turn of a
# session to the same replica by accident.)

# %%
sessions = tenant_sessions(SESSIONS, turns=3, tenants=2, max_doc_chars=DOC_CHARS)
fleet = viz.ThreadFleet(model, n=3, budget_tokens=KV_TOKENS)
for engine, replica in zip(fleet.engines(), fleet.router.replicas):
    print(f"{replica.name}: {engine.cache.num_blocks} blocks of {engine.cache.block_size} tokens")
print(f"{len(sessions)} sessions x 3 turns, tenants {sorted({s.salt for s in sessions})}")

# %% [markdown]
# One session's three turns, one after the other: the first goes to a replica with
# nothing cached anywhere (the least loaded), and that replica's engine publishes the
# blocks it computed; the next turns find them there. The router's index holds them, keyed
# by the same hash the engine computed, in the integer form vLLM's events carry (the last
# 8 bytes of the SHA-256). A replica's first blocks, as the router sees them:

# %%
turns = fleet.run(sessions[:1], "precise", max_tokens=MAX_TOKENS, concurrency=1)
print("replicas of the three turns:", [t.replica for t in turns])
fleet.quiet()
table = viz.index_table(fleet.router, model.tokenizer, per_replica=3)
print(table.to_string(index=False))

# %% [markdown]
# The `hash` column is not kvlab's invention: it is what vLLM would publish for the same
# tokens. The router can compute it from the request alone (its token ids through the
# chat template, the tenant's `cache_salt` in the first block's extra keys, vLLM's seed
# `"vllm-none-hash"`), which is why a lookup needs no call to any replica. The first
# turn's prompt, through the chat template:

# %%
ids = encode_messages(
    model.tokenizer,
    [{"role": "system", "content": SYSTEM}, {"role": "user", "content": sessions[0].messages[0]}],
)
print(f"prompt: {len(ids)} tokens")

# %% [markdown]
# **Check yourself.** With 16-token blocks, how many of this prompt's blocks can a
# replica hit, at most?

# %%
my_full_blocks = None  # your answer: a number of blocks
ask("14.full-blocks", my_full_blocks, ids=ids)

# %%
ours = block_hashes(ids[:-1], 16, salt=sessions[0].salt)
print(f"prompt: {len(ids)} tokens, {len(ours)} full blocks a replica can hit")
print("first block, as the router computes it:", f"{int.from_bytes(ours[0][-8:], 'big'):016x}")
print("the same block, as the replica reported:", table.iloc[0]["hash"])

# %% [markdown]
# How the precise policy scores the replicas with that index: it hashes the request's
# tokens as the engines do, then counts, per replica, the request's hashes it holds *in
# a row from the first* (`longest_prefix`: a block whose parent is gone may still be
# held, but a lookup stops at the gap, as the engine's own does). `by_prefix` picks the
# best score among the replicas the load guard lets compete, the least loaded among
# equals, and writes the reason:

# %%
display(show_source(BlockIndex.longest_prefix))
show_source(Policy.by_prefix)

# %% [markdown]
# **Check yourself.** A toy index: replica r0 holds the block hashes {1, 2, 3}, r1
# {1, 2, 3, 4, 5}, r2 {1, 3, 4, 5}. A request's chain is [1, 2, 3, 4, 6]. What does
# `longest_prefix` score each replica? Write a dict, e.g. `{"r0": 0, "r1": 0, "r2": 0}`.

# %%
toy = BlockIndex()
for replica, chain in {"r0": [1, 2, 3], "r1": [1, 2, 3, 4, 5], "r2": [1, 3, 4, 5]}.items():
    toy.apply(replica, {"type": "BlockStored", "block_hashes": chain, "block_size": 16})
my_scores = None  # your answer: {"r0": ..., "r1": ..., "r2": ...}
ask("14.router-scores", my_scores, index=toy, hashes=[1, 2, 3, 4, 6])

# %% [markdown]
# ## 2 · Where requests go, and why (live)
#
# Now all sessions, three turns each, up to three turns in flight, through the
# **precise** policy. Each dot is a request as the router routed it: its replica, one
# colour per session. The right panel shows, for the request the slider picks, what the
# policy compared: how many of the request's blocks each replica holds in a row from the
# first. A first turn finds at most its tenant's system prompt (a block or two, cached
# wherever another session of that tenant went); every later turn finds its whole
# conversation on one replica and goes home. A prefix every request shares would pull
# every request to one replica: the **load guard** keeps a replica more than 2 requests
# busier than the least busy one out of the contest, and the reason says so when it
# acts. The figure grows as the router decides; then move the slider.

# %%
# NBVAL_IGNORE_OUTPUT
app = viz.RoutingApp(fleet.router)
display(app.widget)
live = fleet.run(sessions, "precise", on_decision=app.add, max_tokens=MAX_TOKENS, concurrency=3)

# %% [markdown]
# The same figure as the run left it, as a static copy (it survives where widgets do
# not: a rendered notebook, a PDF): each dot a request on the replica it went to, one
# colour per session, and the scores behind the last decision.

# %%
# NBVAL_IGNORE_OUTPUT
go.Figure(app.figure).show()

# %% [markdown]
# How many requests were routed on a cached prefix, and on how many replicas each
# session's turns ran (1: all at home; the load guard may send a turn away when its home
# is busy):

# %%
# NBVAL_IGNORE_OUTPUT
later = [e for e in list(fleet.router.decisions) if "cached" in e["reason"]]
homes = {}
for e in fleet.router.decisions:
    homes.setdefault(e["user"], set()).add(e["replica"])
print(f"{len(later)} of {len(fleet.router.decisions)} requests routed on a cached prefix")
print("replicas per session:", sorted(len(v) for v in homes.values()))

# %% [markdown]
# ## 3 · The policies on the same chats
#
# The same sessions from cold caches (each replica resets its prefix cache, which its
# events report as `AllBlocksCleared`, so the router's index empties too) under
# (least-loaded with `FULL_SIZE` only):
#
# * **round-robin**: replicas in turn;
# * **least-loaded**: the fewest requests in flight;
# * **approx-prefix**: llm-d's approximate scorer: chained hashes of 64-character blocks of
#   the prompt, and a memory of what the router itself sent where (no events, no
#   tokenizer: it cannot see evictions);
# * **precise**: the events' index, as above.

# %%
# NBVAL_IGNORE_OUTPUT
results, all_turns = viz.compare_policies(
    fleet, sessions, COMPARED, max_tokens=MAX_TOKENS, concurrency=3
)
names = [r.name for r in fleet.router.replicas]
results.loc["precise"] = summary(live, max(t.start_s + t.e2e_s for t in live), names)
columns = ["hit_rate", "ttft_p50_s", "ttft_p99_s", "tok_s", "imbalance_requests"]
print(results[columns].to_string())
viz.policy_bars(results)

# %% [markdown]
# Round-robin (and least-loaded) spread each conversation over all three replicas: every
# replica ends up caching every session, three times the working set, so the LRU evicts
# what the next turn needs and most prompts are computed again (round-robin's prefix hit
# rate is 43%<!-- out --> here). The precise policy keeps each session on one replica
# (70%<!-- out -->): what a replica caches is a third of the working set and fits. Fewer
# prompt tokens to compute is a shorter prefill, hence the lower time to first token.
# The approximate policy gets the affinity without events (75%<!-- out -->), but it
# guesses: it never learns that a replica evicted a block (here that rarely matters; on
# a full cache it routes to prefixes that are gone). Between the two prefix policies the
# time to first token differs by noise at this size (5 sessions, one run each, on a
# 2-core machine). `benchmarks/replicas.py` measures the
# same comparison with 3 replicas as processes, 5 alternating rounds, and the real vLLM
# Router in front of the same replicas.

# %% [markdown]
# ## 4 · When replicas disagree
#
# The router finds a replica's blocks only if it hashes the way that replica does. Two
# ways to break it, each a one-line config difference:
#
# * **block size**: a replica with 32-token blocks hashes 32 tokens per block; the
#   router, hashing 16 at a time (the block size the first replica's events reported),
#   computes other hashes, none of which that replica ever published;
# * **hash seed**: the chain starts from `NONE_HASH = sha256_cbor(seed)`; vLLM takes the
#   seed from `PYTHONHASHSEED` (else `"vllm-none-hash"`). A replica started with another
#   seed publishes hashes no one else computes. (vLLM's non-cryptographic choices,
#   `xxhash` and the builtin `hash`, draw a random seed per process unless
#   `PYTHONHASHSEED` is set: replicas then never agree.)
#
# A second fleet: r0 as before, r1 with 32-token blocks, r2 with another seed. The same
# prompt goes to each replica directly; then the router looks it up:

# %%
fleet.close()
odd = [
    viz.REPLICA,
    EngineConfig(cache="paged", prefix_caching="hash", block_size=32,
                 prefix_caching_hash_algo="sha256_cbor"),
    EngineConfig(cache="paged", prefix_caching="hash", block_size=16,
                 prefix_caching_hash_algo="sha256_cbor", prefix_caching_hash_seed="0"),
]  # fmt: skip
with viz.ThreadFleet(model, configs=odd, budget_tokens=KV_TOKENS) as mixed:
    print(viz.disagreement(mixed, ids).to_string())

# %% [markdown]
# Every replica cached the prompt (r1 reported its 5<!-- out --> blocks of 32 tokens);
# the router finds all 10<!-- out --> of r0's blocks and none of the others'. Both r1
# and r2 would still *serve* correctly (each engine matches its own hashes), but a
# precise router cannot see their caches and routes to them blind, as round-robin
# would. The fix is configuration, and it is why routers ask for it: llm-d's precise
# scorer takes the engines' block size and hash seed in its config, and vLLM's docs tell
# you to set the same `--block-size`, `--prefix-caching-hash-algo sha256_cbor` and
# `PYTHONHASHSEED` on every replica.
#
# > **Summary.** With several replicas a prefix cache pays off only if the router sends
# > a request to the replica that holds its prefix. vLLM's engines publish what they
# > store and evict as KV events carrying reproducible block hashes (`sha256_cbor`), so a
# > router can keep a block hash -> replicas index, hash a request's tokens itself and
# > score each replica by its longest cached prefix, in a row from the first block.
# > Kept on one replica, a conversation's later turns hit their whole history; spread by
# > round-robin, every replica caches everything and evicts what the next turn needs.
# > The router finds only what it can hash the same way: every replica must share block
# > size, hash algorithm and seed.
#
# ## What to try next
#
# * Set `FULL_SIZE = True`: more sessions and longer answers, a cache under more pressure.
# * `ThreadFleet(model, 3, budget_tokens=2048)`: every replica holds the whole working set,
#   and round-robin catches up (affinity matters only when the fleet's KV is the limit).
# * `ThreadFleet(..., load_guard=0)`: the precise policy sends a request home only when its
#   replica is the least busy; watch the reasons in the live figure.
# * In a terminal: `kvlab serve --kv-events-config '{"enable_kv_cache_events": true,
#   "endpoint": "tcp://*:5557"}' --config '{"cache": "paged", "prefix_caching": "hash",
#   "prefix_caching_hash_algo": "sha256_cbor"}'` on two ports, then
#   `kvlab route --backend http://127.0.0.1:8000,events=tcp://127.0.0.1:5557 ...` and
#   `kvlab replay --endpoint http://127.0.0.1:8080`. The same router reads `vllm serve`
#   replicas started with the same flags.
#
# The stored timings in this notebook come from the machine below (a 2-core CPU unless
# it says otherwise); block hashes and counts are the same on any machine.

# %%
# NBVAL_IGNORE_OUTPUT
print(f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, {device}")
