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
# # 13 · Isolation: what a shared prefix cache tells strangers, and how tenants close it
#
# *Files shown here:* `kvlab/serve/tenants.py` (API keys, the salt of each tenant),
# `kvlab/serve/gate.py` (per-tenant places and queues), `kvlab/serve/audit.py` (reading
# the block tables for cross-tenant hits), `kvlab/cache/prefix/hash.py` (the salted chain
# of block keys), `kvlab/serve/probe.py` and `kvlab/experiments/isolation.py` (the
# attack), `kvlab/viz/isolation.py`. The design page is `docs/design/isolation.md`.
#
# Notebook 03 showed the prefix cache's gift: a request whose opening was seen before
# skips that part of its prefill. On a server that many people share, the gift has a
# price. **Whether your prompt hit the cache shows in how fast your first token comes**,
# so by choosing what to send, one user can learn what another user sent: a system
# prompt, a document, a secret. The attack is published. Song et al. time the first
# token to tell KV-cache hits from misses and recover system prompts and other users'
# prompts token by token ([The Early Bird Catches the Leak, arXiv:2409.20002](https://arxiv.org/abs/2409.20002));
# Gu et al. audited commercial APIs with the same signal and found caches shared
# *across users* at seven providers, OpenAI among them
# ([Auditing Prompt Caching in Language Model APIs, arXiv:2502.07776](https://arxiv.org/abs/2502.07776)).
# Engines answer it with *salts*: a namespace mixed into the blocks' hashes, so two users
# with different salts never share a block. vLLM takes one per request (`cache_salt`,
# hashed into the first block and carried by the chain: see
# [its prefix-caching design](https://docs.vllm.ai/en/latest/design/prefix_caching/));
# `kvlab serve` also gives every tenant (API key) its own.
#
# This notebook, over real HTTP to a running `kvlab serve` on the real model:
#
# 1. the attack on a shared cache: first-token times of right and wrong guesses, and
#    how often the attacker guesses right;
# 2. the same attack with per-tenant salts, where the signal must vanish;
# 3. the "shared" system prompt that carries per-user PII near its start, and what
#    `engine.explain` says about its misses.
#
# Set-up: one cell picks the device (CUDA if present, else CPU), seeds torch and loads
# the model. `FULL_SIZE = True` runs 24 attack trials per setting instead of 4.

# %%
import platform

import plotly.io as pio
import torch
from IPython.display import display

import kvlab
from kvlab.cache.prefix.hash import block_hashes
from kvlab.config import SamplingParams
from kvlab.course import ask, show_source
from kvlab.experiments import isolation
from kvlab.serve import ServerThread, engine_config
from kvlab.serve.tenants import Tenants, engine_salt
from kvlab.viz.isolation import attack_figure

pio.renderers.default = "plotly_mimetype"
torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
model = kvlab.load_model(device=device, progress=False)
FULL_SIZE = False  # True: 24 trials per setting instead of 4 (minutes on a 2-core CPU)
TRIALS = 24 if FULL_SIZE else 4

# %% [markdown]
# ## 1 · The attack on a shared cache
#
# A server as `vllm serve` runs by default: no API keys, one prefix cache for everyone.
# The notebook starts it in a thread on a free loopback port (`ServerThread`); every
# request below is a real HTTP request to it.
#
# The victim's prompt opens with a secret, *"The ACME vault code is 481920."*, then
# ~130 tokens of instructions. The attacker knows the
# template and can list candidate codes. For each trial the victim sends a prompt with a
# fresh code; the attacker then sends two guesses as openings of its own prompt, the
# right code and a wrong one, and times each first token (`max_tokens=1`, streamed).
#
# A right guess finds every full block of the victim's prompt in the cache and
# prefills only its own last few tokens; a wrong guess differs from the first block on
# (the whole code sits in it), and every later block's key chains through that one, so
# it prefills everything. Before the trials the attacker sends one throwaway request
# (a new connection and the engine's first prefills are slow), then calibrates a
# threshold on its own prompts, each sent twice: a miss, then a hit. A guess whose first
# token comes sooner than the threshold it calls "cached".

# %%
prompt_tokens = len(isolation.secret_ids(model.tokenizer, "481920"))
print(f"the victim's secret prompt: {prompt_tokens} tokens, {prompt_tokens // 16} full blocks")
shared_engine = kvlab.Engine(model, engine_config("paged+prefix", max_model_len=1024))
server = ServerThread(shared_engine).start()
shared = isolation.timing_attack(server.url, model.tokenizer, trials=TRIALS)
server.stop()

# %% [markdown]
# The server did more than answer faster. OpenAI's API (and vLLM's) tells a client how
# many of its prompt tokens were cached (`usage.prompt_tokens_details.cached_tokens`),
# so on a shared cache the attacker does not even need a clock:

# %%
isolation.cached_tokens_seen({"shared cache": shared})

# %% [markdown]
# ## 2 · The same attack across tenants
#
# Now the server has API keys: a keys file maps each key to a tenant
# (`kvlab serve --api-keys-file keys.json`), and each tenant's prompts are hashed with
# its own salt (`engine_salt(tenant, cache_salt)`: the tenant comes from the key, never
# from the body, so no request can name another tenant's namespace). The victim is
# tenant `acme`, the attacker tenant `mallory`; everything else is the same.
#
# Where the salt goes: `engine_salt` turns the tenant (and any `cache_salt`) into the
# request's namespace, and the hash index feeds it into every block's key, beside the
# parent's key and the block's token ids (kvlab's own `blake2b` keys, which this server
# uses; with vLLM's `sha256_cbor` keys the salt sits in the first block's extra keys and
# the chain carries it to the rest, as vLLM does):

# %%
display(show_source(engine_salt))
show_source(block_hashes, start='parent = b"" if seed', end="return keys")

# %% [markdown]
# **Check yourself.** On this salted server, how many of the victim's 144<!-- out -->
# prompt tokens can the attacker's *right* guess (the very same token ids as the
# victim's opening) hit?

# %%
my_salted_hits = None  # your answer: a number of tokens
ask("13.salted-hit-tokens", my_salted_hits,
    victim_ids=isolation.secret_ids(model.tokenizer, "481920"),
    victim_salt=engine_salt("acme", None), attacker_salt=engine_salt("mallory", None))  # fmt: skip

# %%
keys = Tenants((("sk-acme", "acme"), ("sk-mallory", "mallory")))
salted_engine = kvlab.Engine(model, engine_config("paged+prefix", max_model_len=1024))
server = ServerThread(salted_engine, tenants=keys).start()
salted = isolation.timing_attack(
    server.url, model.tokenizer, trials=TRIALS, victim_key="sk-acme", attacker_key="sk-mallory"
)
server.stop()
frames = {"shared cache": shared, "per-tenant salts": salted}
isolation.cached_tokens_seen(frames)

# %% [markdown]
# The attacker's own prompts still hit its own blocks (its calibration pair does), but
# no guess ever reaches the victim's. First-token times of every probe, by guess, and
# the attacker's threshold:

# %%
# NBVAL_IGNORE_OUTPUT
attack_figure(frames)

# %%
# NBVAL_IGNORE_OUTPUT
isolation.attack_summary(frames)

# %% [markdown]
# With the shared cache the right guesses' first tokens came after a median of
# 0.063<!-- out --> s and the wrong ones' after 0.282<!-- out --> s, and in every trial the
# right guess answered first (1.00<!-- out -->): an attacker who compares its two guesses
# never errs, and its fixed threshold, calibrated on its own prompts, was right every
# time too (accuracy 1.0<!-- out -->; on a machine loaded by other work some misses come
# in under it). With salts both guesses prefill everything and neither is faster but by
# noise: the right guess came first in 0.75<!-- out --> of the trials (3 of 4: no
# different from a coin at this sample size) and the threshold's accuracy is
# 0.5<!-- out -->, a coin's (4 trials per setting, 4 probes per box; `FULL_SIZE` runs 24).
#
# What the salt does not hide: how loaded the server is (every tenant's requests share
# its steps, so a flood slows everyone; `--tenant-max-running` bounds what one tenant
# holds, `benchmarks/tenant_flood.py` measures it), and `/metrics`, whose vLLM series
# count every tenant together. See `docs/design/isolation.md` for the whole list.

# %% [markdown]
# ## 3 · The "shared" system prompt that starts with the user
#
# A common way to build a prompt: a line about the customer, then the long instructions
# every customer gets. The instructions look shared, but the cache shares *prefixes*, in
# whole blocks, chained from the first: a different first block makes every block after
# it different. The three users' prompts in each layout, as token ids, and how many
# tokens the users' prompts open with in common:

# %%
layouts = {layout: [model.tokenizer.encode(p) for p in isolation.pii_prompts(layout)]
           for layout in ("PII first", "PII last")}  # fmt: skip
for layout, prompts in layouts.items():
    first, second = prompts[0], prompts[1]
    common = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    print(f"{layout}: prompts of {[len(p) for p in prompts]} tokens; users 1 and 2 share "
          f"their first {common}")  # fmt: skip

# %% [markdown]
# **Check yourself.** Served one after the other on one engine (blocks of 16), how many
# prompt tokens does the *second* user's request hit in the "PII last" layout?

# %%
my_pii_last_hits = None  # your answer: a number of tokens
ask("13.pii-last-hits", my_pii_last_hits, first=layouts["PII last"][0],
    second=layouts["PII last"][1])  # fmt: skip

# %% [markdown]
# Each layout's prompts go through one engine, user after user:

# %%
engine = kvlab.Engine(model, engine_config("paged+prefix", max_model_len=1024))
table, explained = isolation.pii_layouts(engine, SamplingParams(max_new_tokens=1))
print(table)

# %% [markdown]
# With the PII first, no user reuses a token of the instructions: every request pays for
# the whole prefill, and the cache fills with copies of the same instructions, one per
# user. And on a shared cache each of those first blocks is a question anyone can ask:
# "is there a customer Alice Moreau with account 4471-0093?". `engine.explain` says why
# the third user missed:

# %%
print(explained["PII first"])

# %% [markdown]
# Moved after the instructions, the per-user line sits in the user's own last blocks:
# the instructions are computed once and every later user hits them, 128<!-- out -->
# tokens each here.

# %%
print(explained["PII last"])

# %% [markdown]
# > **Summary.** A shared prefix cache answers a question anyone can ask: "has this
# > opening been seen?", through the time to the first token and through
# > `cached_tokens` in the usage. A salt closes it: hashed into the blocks' keys, it
# > gives each tenant (or each `cache_salt`) a namespace of its own, so a guess from
# > outside never meets the victim's blocks, right or wrong. What it cannot hide is load
# > and the server-wide metrics. Inside one namespace, share what is really shared: put
# > the long common instructions first and the per-user line after them, or nothing
# > after the line is shared and each user's line can be probed.
#
# ## What to try next
#
# * Set `FULL_SIZE = True`: 24 trials per setting, tighter boxes.
# * Give the victim and attacker the *same* tenant but different `cache_salt`s (vLLM's
#   request field, `extra_body={"cache_salt": ...}` in the openai SDK): users of one
#   tenant are separated the same way.
# * Change `SECRET` in `kvlab/experiments/isolation.py` to put the code after the
#   instructions: on the shared cache, a wrong guess now hits every block before the
#   code, and the gap between right and wrong guesses shrinks to the last blocks.
# * Start `kvlab serve --api-keys-file keys.json --tenant-max-running 2` in a terminal
#   and flood it from one key while timing another (`benchmarks/tenant_flood.py`).
#
# The stored timings in this notebook come from the machine below (a 2-core CPU unless
# it says otherwise); token counts are the same on any machine.

# %%
# NBVAL_IGNORE_OUTPUT
print(f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, {device}")
