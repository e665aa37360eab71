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
# # 09 · Speculative decoding: drafts, verification in one forward, rollback
#
# *Engine files shown here:* `kvlab/speculative/ngram.py` (prompt lookup),
# `kvlab/speculative/layers.py` (a self-speculative draft from the model's first layers),
# `kvlab/speculative/verify.py` (greedy acceptance, rejection sampling),
# `kvlab/speculative/speculator.py` (plan, draft, verify, rollback), `kvlab/cache/base.py`
# and `kvlab/cache/paged.py` (`KVCache.rewind`),
# `kvlab/engine/scheduler.py` (1 + k slots per decode), `kvlab/engine/core.py`;
# measured by `kvlab/experiments/speculative.py` and `kvlab/peers/spec_hf.py`,
# drawn by `kvlab/viz/speculative.py`.
#
# A decode step computes one token per sequence, and on a GPU at small batch it is
# bound by reading the weights, not by arithmetic: computing 5 tokens in the forward
# costs about as much as 1. Speculative decoding spends that slack. A cheap **proposer**
# drafts k tokens; the model computes the pending token *and* the k drafts in one
# forward; the logits at each position say which drafts the model agrees with. The
# accepted drafts and one more token from the model are emitted, so one forward yields
# 1 to k + 1 tokens, and greedy outputs are **exactly** those of ordinary decoding
# ([Leviathan et al.](https://arxiv.org/abs/2211.17192) and
# [Chen et al.](https://arxiv.org/abs/2302.01318) prove that rejection sampling keeps
# sampled outputs' distribution too).
#
# What this means for the KV cache: the drafts' K/V are written into slots (in a paged
# cache, perhaps into blocks allocated just for them) before anyone knows whether they
# will be kept. After verification the cache **rolls back**: `num_computed` drops to the
# accepted length, blocks that held only rejected drafts go back to the free list, and
# nothing drafted is ever published to the prefix index. vLLM V1 rewinds
# `num_computed_tokens` the same way; SGLang frees the rejected slots; TensorRT-LLM trims
# the cache tail.
#
# Two proposers are registered in `kvlab.speculative.PROPOSERS`:
#
# * **`ngram`** (prompt lookup; vLLM's `ngram` method, HF's `prompt_lookup_num_tokens`):
#   the tokens that followed an earlier occurrence of the sequence's last n tokens. No
#   draft model. It shines when answers quote their input (doc-QA), not in free chat.
# * **`layers`**: the model's own first layers, then its final norm and LM head, draft
#   autoregressively, reading and writing the target's KV pool. No second model, but a
#   shallow exit guesses worse: its acceptance is measured below, not assumed.
#
# Set-up: one cell picks the device (CUDA if present, else CPU), seeds torch and loads
# the model. By default three doc-QA prompts (the first of the seeded set of at most 800
# tokens) and one chat prompt, answers of up to 32 tokens, n-gram drafts of k = 2, 4 and
# 8: enough verified rows for the acceptance rates to mean something.
# `FULL_SIZE = True` runs longer prompts (up to ~1,900 tokens), 64-token answers, k = 1
# too, HF's prompt lookup (each run then prefilling its prompt inside its time, as HF's
# do) and batch 16 (several minutes on a CPU).

# %%
import os
import platform

import pandas as pd
import plotly.io as pio
import torch

import kvlab
from kvlab import SamplingParams
from kvlab.cache.base import KVCache
from kvlab.config import SpeculativeConfig
from kvlab.course import ask, show_source
from kvlab.experiments import speculative
from kvlab.speculative.speculator import Speculator
from kvlab.viz.speculative import batch_figure, describe_event, k_figure, rollback_animation

pio.renderers.default = "plotly_mimetype"
torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
model = kvlab.load_model(device=device, progress=False)
pd.set_option("display.width", 200)

FULL_SIZE = False  # True: 3 + 3 prompts, 64-token answers, HF's prompt lookup, batch 16
DOC_QA, CHAT, NEW_TOKENS = (3, 3, 64) if FULL_SIZE else (3, 1, 32)
SEED, MAX_PROMPT = (0, None) if FULL_SIZE else (4, 800)  # which prompts, how long at most
KS = (1, 2, 4, 8) if FULL_SIZE else (2, 4, 8)  # n-gram drafts per step compared

# %% [markdown]
# ## 1 · The prompts
#
# Doc-QA: the ~300-token assistant preamble, a document, a question. The answer quotes
# the document, so the n-gram proposer finds it earlier in the prompt. Chat: short
# everyday prompts with nothing to quote. Answers are greedy and stop at EOS (at most
# `NEW_TOKENS`).

# %%
workloads = speculative.spec_workloads(model, DOC_QA, CHAT, NEW_TOKENS, MAX_PROMPT, SEED)
for name, requests in workloads.items():
    print(f"{name}: prompt tokens {[len(r.prompt) for r in requests]}")

# %% [markdown]
# ## 2 · Draft → verify → rollback in a block table
#
# One paged engine with 4-slot blocks (so drafts cross block boundaries) and prefix
# caching, on the first doc-QA prompt. The run without speculation prefills the prompt
# (its blocks stay in the prefix cache); the run with n-gram drafting (k = 4, n-grams of 2
# to 4 tokens) then finds those blocks and only decodes. `set_speculation` swaps the
# engine's speculator between runs. The two runs must emit the same tokens.

# %%
doc = workloads["doc-qa"][0]
engine = speculative.prefix_engine(model, workloads["doc-qa"], block_size=4)
params = SamplingParams(max_new_tokens=doc.max_new_tokens)
plain = engine.generate([list(doc.prompt)], params)[0]
ngram = SpeculativeConfig("ngram", 4, prompt_lookup_min=2, prompt_lookup_max=4)
speculator = Speculator(ngram, engine.runner, engine.cache, engine.max_model_len, record=True)
speculative.set_speculation(engine, speculator)
drafted = engine.generate([list(doc.prompt)], params)[0]
speculative.set_speculation(engine, None)
print("answer:", repr(drafted.text))
print("same tokens as without speculation:", drafted.token_ids == plain.token_ids)
print(speculator.stats.as_dict())

# %% [markdown]
# `verify_rows` counts the decode forwards that carried drafts (here 7<!-- out --> of
# 10<!-- out -->); `tokens_per_forward` is the output tokens per target forward of this
# sequence (1.0 without speculation; here 3.1<!-- out -->, the answer quoting its
# document);
# `rolled_back_blocks` counts blocks allocated for drafts that were all rejected, then
# returned.
#
# The engine's side, in `Speculator`: `verify` asks `accept` which drafts the model
# agrees with (greedy: drafts while each equals its row's argmax, then the argmax of the
# first row that disagrees); `rollback`, once the emitted tokens are appended, rewinds the
# cache to all but the last token (the next step computes that one):

# %%
show_source(Speculator, start="def verify(", end="seq.draft_ids, seq.spec_room = [], 0")

# %% [markdown]
# and `KVCache.rewind` forgets the rejected positions and hands back the blocks past the
# kept ones (the codec rolls back any state the drafts touched):

# %%
show_source(KVCache.rewind, start="if not 0 <= num_computed", end="return len(freed)")

# %% [markdown]
# **Check yourself.** A row carries drafts `[11, 42, 7, 93]`, and the verify forward's
# argmax at its five positions is `[11, 42, 8, 93, 5]` (position 0 predicts the token after
# the pending one). Which tokens does the row emit, in order?

# %%
my_emitted = None  # your answer: a list of token ids
ask("09.greedy-emit", my_emitted, drafts=[11, 42, 7, 93], target=[11, 42, 8, 93, 5])

# %% [markdown]
# Each verified row left a `SpecEvent`: where its pending token sat, its drafts, how many
# were accepted, and the block table while verifying and after the rollback. The first:

# %%
events = speculator.events
first = events[0]
print(f"pending token at position {first.position}, {len(first.drafts)} drafts, "
      f"{first.accepted} accepted, blocks of 4 slots")  # fmt: skip

# %% [markdown]
# **Check yourself.** How many blocks does that row's rollback return to the free list?

# %%
my_returned = None  # your answer: a whole number of blocks
ask("09.rollback-blocks", my_returned, event=first, block_size=4)

# %% [markdown]
# The first rows, with their tables (the last two blocks) before and after:

# %%
for e in events[:8]:
    print(describe_event(e))

# %% [markdown]
# The animation walks through them: in the **verify** frame, the pending token (dark
# blue) and the drafts (green: accepted, red: rejected) hold slots of the table's last
# blocks; in the **rollback** frame the rejected slots are forgotten and any block that
# held only rejected drafts is returned (orange). Press *play* or drag the slider.

# %%
rollback_animation(events[:16], block_size=4, rows=3)

# %% [markdown]
# ## 3 · Acceptance and speed-up against k, doc-QA against chat
#
# `compare_speculation` runs every configuration at batch 1 on the same prompts, one
# prompt at a time: no speculation, n-gram at each k in `KS` (2, 4, 8; 1 too at full
# size), and the `layers` draft (the first 7 of 30 layers, k = 2); with `FULL_SIZE`, HF
# `generate` plain and with `prompt_lookup_num_tokens=k` too. Speculation speeds up
# decoding, not the prefill, so each prompt is prefilled once, untimed, into the prefix
# cache (the engine above is reused: it holds the first prompt already), and every
# timed run decodes from its cached K/V (`cold=FULL_SIZE`: with HF in the comparison,
# each run instead starts from an **empty prefix cache** and prefills inside its own
# time, as HF's runs do). Then n-gram at k = 4 against none as the batch grows.
# Tokens per forward and acceptance are deterministic on greedy runs; `decode_forwards`
# counts the forwards behind them (every decode row, with or without drafts):

# %%
result = speculative.compare_speculation(
    model,
    workloads,
    ks=KS,
    hf=FULL_SIZE,
    sweep_batch_sizes=(1, 4, 16) if FULL_SIZE else (1, 4),
    engines={"doc-qa": engine},
    cold=FULL_SIZE,  # False: every run decodes from its prompt's cached K/V
)
frame = result.frame()
frame["decode_forwards"] = [r.decode_forwards for r in result.runs]
exact = ["part", "workload", "system", "method", "k", "batch_size", "output_tokens",
         "drafted", "accepted", "tokens_per_forward", "acceptance_rate", "identical",
         "decode_forwards"]  # fmt: skip
print(frame[exact].to_string())
print("mismatches:", result.mismatches())

# %% [markdown]
# On doc-QA the n-gram drafts are often right (the answers quote the documents): a
# forward yields 1.547<!-- out --> tokens at k = 2 and 1.864<!-- out --> at k = 8, while
# acceptance falls from 0.617<!-- out --> to 0.339<!-- out -->: each doubling of k adds
# little and drafts many more rejected tokens. On chat n-gram rarely finds a draft at
# all, and none of those it found was accepted. The `layers` draft (7 of 30 layers) is a
# poor guesser on a model this small: 0.013<!-- out --> of its drafts accepted on doc-QA.
#
# The timings (speed-ups are over the same system without speculation; `decode_tok_s`
# counts decode steps only, `wall_tok_s` the whole `generate` call, here little more as
# the prompt comes from the prefix cache). Each configuration ran once per prompt, the
# order of the configurations alternating from prompt to prompt (`repeats=2` runs each
# twice in interleaved rounds and keeps the faster, steadier on a busy machine). The
# chat n-gram rows are the yardstick: n-gram drafted only a handful of tokens there and
# none was accepted, so their speed-ups should be about 1.0, and how far they stray is
# this run's noise. The cell prints the load average (runnable processes) beside the 2
# cores.

# %%
# NBVAL_IGNORE_OUTPUT
timed = ["part", "workload", "system", "method", "k", "batch_size", "decode_tok_s",
         "wall_tok_s", "decode_speedup", "wall_speedup"]  # fmt: skip
print(frame[timed].to_string())
print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
k_figure(frame)

# %% [markdown]
# ## 4 · Why the speed-up is smaller on a CPU, and where it stops paying
#
# Verifying k drafts is "free" only when the forward is bound by reading the weights.
# On this CPU a matmul on 5 rows costs 2-3 times one on 1 row (the BLAS library's
# small-M kernels), so each rejected draft costs real compute. The cost of the model's
# first MLP on m tokens at once:

# %%
# NBVAL_IGNORE_OUTPUT
costs = speculative.verify_cost(model)
print({f"{m} rows": f"{ms} ms ({ms / costs[1]:.1f}x one row)" for m, ms in costs.items()})

# %% [markdown]
# And as the batch grows, a forward already computes many rows: drafts add more rows
# to a step that is no longer waiting on memory, so the speed-up shrinks and, past some
# batch size, turns into a slow-down. This is why serving engines switch speculation
# off at high load.

# %%
# NBVAL_IGNORE_OUTPUT
batch_figure(frame)

# %% [markdown]
# > **Summary.**
# > * A speculative step drafts k tokens cheaply, computes the pending token and the
# >   drafts in one forward, and emits the accepted drafts plus one token of the model's
# >   own: 1 to k + 1 tokens per forward, greedy outputs exactly unchanged.
# > * The drafts' K/V are written before they are judged; the rollback rewinds
# >   `num_computed` and returns the blocks that held only rejected drafts.
# > * Prompt lookup pays when answers quote their input (doc-QA), not in free chat; a
# >   longer draft is accepted less often.
# > * Verifying is cheap only where a forward is bound by reading weights (a GPU at small
# >   batch); on a CPU, and at large batch, each rejected draft costs real compute.
#
# ## What to try next
#
# * `python benchmarks/speculative.py` runs the full comparison (3 + 3 prompts, HF's
#   prompt lookup in the same run, batch sizes 1, 4, 16) and prints JSON.
# * Try `SpeculativeConfig("ngram", 4, prompt_lookup_min=1)`: 1-grams match more often
#   and more wrongly. Try `SpeculativeConfig("layers", 2, draft_layers=15)`: a deeper
#   draft accepts more but costs more per draft token.
# * Sample (`SamplingParams(temperature=0.8, seed=0)`): drafts are then accepted by
#   rejection sampling (`kvlab/speculative/verify.py`), which keeps the model's distribution.
# * Run section 2 with `kv_codec="kivi2"`: drafts stop one short of a 16-token key
#   group, so rejected drafts never reach its scales.
#
# The stored timings come from the machine below (a shared 2-core CPU unless it says
# otherwise).

# %%
# NBVAL_IGNORE_OUTPUT
machine = platform.processor() or platform.machine()
print(f"{machine}, {os.cpu_count()} cores, torch on {torch.get_num_threads()} threads, {device}")
