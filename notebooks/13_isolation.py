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
# prompt, a document, a secret. The attack is published (prompt-leaking through prefix
# caching, on vLLM and SGLang deployments), and engines answer it with *salts*: a
# namespace mixed into every block's hash, so two users with different salts never
# share a block. vLLM takes one per request (`cache_salt`); `kvlab serve` also gives
# every tenant (API key) its own.
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
# the model.

# %%
import platform

import plotly.io as pio
import torch

import kvlab
from kvlab.config import SamplingParams
from kvlab.experiments import isolation
from kvlab.serve import ServerThread, engine_config
from kvlab.serve.tenants import Tenants
from kvlab.viz.isolation import attack_figure

pio.renderers.default = "plotly_mimetype"
torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
model = kvlab.load_model(device=device, progress=False)
FULL_SIZE = False  # True: 24 trials per setting instead of 6 (minutes on a 2-core CPU)
TRIALS = 24 if FULL_SIZE else 6

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
# it prefills everything. Before the trials the attacker calibrates a threshold on its own
# prompt, sent twice: a miss, then a hit.

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
# With the shared cache the two boxes sit far apart and the threshold splits them: the
# attacker tells right from wrong nearly every time. With salts both guesses prefill
# everything, their times overlap, and the attacker's accuracy falls to a coin's: it
# calls every guess "not cached", right on the wrong guesses only (one half).
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
# it different. Each layout's prompts go through one engine, user after user:

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
# the instructions are computed once and every later user hits them.

# %%
print(explained["PII last"])

# %% [markdown]
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
