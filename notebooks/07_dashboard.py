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
# # 07 · Putting it together: what each design buys, on one workload
#
# *Engine files shown here:* `kvlab/presets.py` (config names), `kvlab/cache/paged.py`
# (the cache assembled from a config), `kvlab/experiments/compare.py`,
# `kvlab/viz/compare.py`, `kvlab/viz/dashboard.py`; in the second half,
# `kvlab/experiments/bench.py`, `kvlab/peers/hf.py`, `kvlab/peers/vllm_bench.py`.
#
# The earlier notebooks each built one part: paging, prefix sharing, quantized KV, the
# scheduler, kernels. This one assembles them into engines and serves **one workload,
# with one model and one KV budget in bytes**, through each, asking of every design one
# question: *what does it buy?*
#
# * **memory**: what each design reserves, what it holds, and so how many requests run at
#   once;
# * **work**: how many prompt tokens it computes (prefix caching skips some);
# * **time**, honestly: on this machine, a 2-core CPU, and why the answer would differ on a
#   GPU.
#
# The lesson is sections 1-4 (about 25 minutes). **Further** (sections 5-8) is a second
# sitting or homework: the full-size run, kvlab beside Hugging Face and vLLM, and the
# dashboard.
#
# Set-up: one cell picks the device (CUDA if present, else CPU), seeds torch and loads
# the model.

# %%
import json
import os
import platform
from pathlib import Path

import pandas as pd
import plotly.io as pio
import torch

import kvlab
from kvlab import workloads
from kvlab.cache.paged import PagedCache
from kvlab.course import ask, show_source
from kvlab.experiments.bench import DEFAULT_PEERS, BenchResult, run_bench
from kvlab.experiments.compare import compare
from kvlab.model.runner import kv_spec_of
from kvlab.peers.vllm_peer import vllm_missing
from kvlab.presets import parse_config
from kvlab.viz.bench import bench_figure
from kvlab.viz.compare import comparison_figures
from kvlab.viz.dashboard import Dashboard
from kvlab.workloads import encode_requests

pio.renderers.default = "plotly_mimetype"
torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
model = kvlab.load_model(device=device, progress=False)
spec = kv_spec_of(model.config)
RESULTS = Path("../benchmarks/results")  # saved `kvlab compare` / `kvlab bench` runs

# %% [markdown]
# ## 1 · The workload
#
# Four document-QA requests (notebook 03): the same ~300-token assistant preamble, a
# document, a question. To keep every design's run to seconds on a 2-core CPU we take a
# seed whose documents are among the shortest (prompts of 457-576 tokens) and short
# answers, 4 to 16 tokens (the prompts hold most of the KV and the work). All arrive at
# once and each produces exactly its `max_new_tokens` (`ignore_eos`), so every design
# serves the same tokens, and every count below is the same on every run and every
# machine.

# %%
N, SEED = 4, 2387  # doc-QA requests, and a seed whose documents are among the shortest
ANSWERS = {"short_answer": (4, 8), "long_answer": (12, 16)}  # max_new_tokens ranges
requests = workloads.doc_qa(n=N, seed=SEED, **ANSWERS)
encoded = encode_requests(model, requests)
prompt_tokens = [len(r.prompt) for r in encoded]
print("prompt tokens: ", prompt_tokens, "=", sum(prompt_tokens))
print("max_new_tokens:", [r.max_new_tokens for r in requests])
shared = len(os.path.commonprefix([list(r.prompt) for r in encoded]))
print("tokens every prompt starts with (the preamble):", shared)

# %% [markdown]
# **Check yourself.** `paged+prefix` caches whole 16-token blocks by the hash of their
# tokens and everything before them (vLLM's design, notebook 03); a later prompt reuses
# the blocks its prefix matches. What share of the four prompts' tokens will it serve
# from the cache instead of computing (`prefix_hit_rate`)? Compute it from the figures
# printed above.

# %%
my_hit_rate = None  # your answer: a share between 0 and 1, computed in code
ask("07.hit-rate", my_hit_rate, requests=encoded, block_size=16)

# %% [markdown]
# ## 2 · One name, one engine
#
# A design is named by a config: a cache kind and its options, `paged+prefix+int8`.
# `parse_config` turns the name into `EngineConfig` fields, each option looked up in a
# table (`FLAGS`) or a registry (prefix indexes, KV codecs), so a newly registered part is
# a valid option at once:

# %%
show_source(parse_config, start="cache, *parts =", end="check_config(config)")

# %% [markdown]
# `Engine(model, config)` then builds the parts (`kvlab/build.py`): the KV pool the budget
# buys in the codec's bytes per token, and the cache over it. For the paged cache, the
# config picks its prefix index, its admission watermark, its retention policy and its
# tier connector. Read which field decides each:

# %%
show_source(PagedCache.from_config, start="index = config.prefix_caching", end="connector)")

# %%
for name in ("naive", "paged", "paged+prefix", "paged+prefix+int8", "paged+prefix+kernels"):
    c = parse_config(name)
    print(f"{name:21} cache={c.cache!r:8} prefix_caching={c.prefix_caching!r:7} "
          f"kv_codec={c.kv_codec!r:7} attention={c.attention!r}")  # fmt: skip

# %% [markdown]
# Every config gets `max_model_len` = 1,024 (room for these documents and their answers)
# and the **same KV budget in bytes**: room for one naive sequence, 1,024 token slots in
# fp32 (1,024 × 46,080 bytes = 45 MiB), that is 64 blocks of 16 tokens.
#
# **Check yourself.** `int8` stores each K and V element in one byte, plus a bf16 scale
# per token per head (notebook 04). How many 16-token blocks does the same budget hold
# in int8? Compute it from `budget` and `spec` (the model's layers, KV heads, head size).

# %%
MAX_MODEL_LEN = 1024
budget = MAX_MODEL_LEN * spec.bytes_per_token(model.dtype)  # one naive sequence, in bytes
print(spec, "| budget", f"{budget:,}", "bytes")

# %%
my_int8_blocks = None  # your answer: a whole number of blocks, computed in code
ask("07.int8-blocks", my_int8_blocks, budget=budget, spec=spec, dtype=model.dtype, block_size=16)

# %% [markdown]
# ## 3 · What each design buys in memory
#
# `kvlab.experiments.compare.compare` serves the workload once per config:
#
# | config | what it is |
# |---|---|
# | `naive` | one contiguous region of `max_model_len` slots per sequence |
# | `paged` | 16-slot blocks handed out as tokens arrive (vLLM's PagedAttention) |
# | `paged+prefix` | plus hash prefix caching: the shared preamble is stored once |
# | `paged+prefix+int8` | plus K/V stored as int8 with a bf16 scale per token per head |
# | `paged+prefix+kernels` | `paged+prefix`, attention through kvlab's native CPU kernels |
#
# Every design runs in kvlab's default mode, as a server would. (The designs run
# different numbers of requests at once, and in fp32 the order of a sum can depend on the
# batch, so a near-tie could in principle flip a greedy token: notebook 15's
# batch-invariant mode rules that out, at several times the cost per token on a CPU.)

# %%
CONFIGS = ("naive", "paged", "paged+prefix", "paged+prefix+int8", "paged+prefix+kernels")
load_before = os.getloadavg()
result = compare(
    model,
    requests,
    CONFIGS,
    budget_bytes=budget,
    max_model_len=MAX_MODEL_LEN,
    workload=f"doc-qa, {N} requests",
)
load_after = os.getloadavg()
table = result.table()
for name, run in result.runs.items():  # the work each design did, counted per step
    table.loc[name, "steps"] = len(run.stats)
    table.loc[name, "tokens_computed"] = int(run.stats["tokens"].sum())
table = table.astype({"steps": int, "tokens_computed": int})
exact = ["peak_concurrent", "reserved_bytes", "live_bytes", "waste_frac", "prefix_hit_rate",
         "preemptions", "output_tokens", "steps", "tokens_computed"]  # fmt: skip
print(table[exact].to_string())

# %% [markdown]
# What each design bought, read off the table:
#
# * **naive** reserves a whole 1,024-slot region for each request: the budget holds one,
#   so the requests run one at a time, and about half of what it reserves is never written
#   (`waste_frac` **0.4942**<!-- out -->); the longer a server's `max_model_len`, the
#   larger that share.
# * **paged** reserves blocks as tokens arrive; its waste is only the tail of each
#   sequence's last block (**0.0118**<!-- out -->). kvlab's default admission admits a
#   request as soon as the blocks for its first step's tokens are free, keeping none in
#   reserve (its `watermark`, the share of blocks kept free, is 0 by default; vLLM V1
#   keeps none either), and preempts if later growth runs out: so two requests run at
#   once in the same bytes.
# * **paged+prefix** stores the preamble once: `prefix_hit_rate` is the share of prompt
#   tokens served from the cache (your answer above), the blocks saved make room for a
#   third request, and the tokens computed drop from 2144<!-- out --> to 1232<!-- out -->.
# * **paged+prefix+int8** holds nearly 4× the tokens in the same bytes (your second
#   answer above): all four requests run
#   at once, and it reserves **14826240**<!-- out --> bytes at its peak where the others
#   reserve about 45 MB. The later three share the first one's preamble blocks in their
#   very first step: a prompt's blocks are published as soon as the step that fills them
#   is scheduled (as in vLLM V1), so the hit rate is the same.
# * **paged+prefix+kernels** changes how attention is computed, not what is stored: the
#   same memory, steps and tokens as `paged+prefix`. What it buys is time (section 4).
#
# ("tokens computed" counts every token a forward computed: the prompt tokens not served
# from the cache, and one per decode row.)
#
# The cache decides where K/V live, not what the model computes, so naive, paged and
# paged+prefix should produce the same greedy tokens (up to a batch-dependent near-tie,
# above); int8 rounds K/V and may change a few:

# %%
# NBVAL_IGNORE_OUTPUT
outputs = {name: run.outputs for name, run in result.runs.items()}
for name in outputs:
    same = sum(a == b for a, b in zip(outputs["naive"], outputs[name]))
    print(f"{name:21} {same} of {len(requests)} answers identical to naive")

# %% [markdown]
# Memory against engine steps (the same plot on every machine): reserved (solid) and live
# (dotted) KV memory of each design, the budget dashed; below, the sequences running.
# The naive lines sit far apart (reserved but unwritten); the paged ones nearly coincide;
# int8's sit lowest and its four requests finish in the fewest steps.

# %%
figures = comparison_figures(result, x="step")
figures["memory"].show()

# %% [markdown]
# ## 4 · What each design buys in time, on this machine
#
# The same runs' timings. One run each on a shared machine, so a difference of a few tens
# of percent can be noise; the load average (runnable processes, against 2 cores) is
# printed beside them. The work behind the timings is the table above: what a design does
# not compute, it cannot spend time on.

# %%
# NBVAL_IGNORE_OUTPUT
timing = table[["steps", "tokens_computed", "wall_s", "tok_s", "ttft_p50_s", "tpot_p50_s"]].copy()
timing["ms_per_token_computed"] = (1000 * timing["wall_s"] / timing["tokens_computed"]).round(2)
print(timing.to_string())
print(f"load average before {load_before[0]:.1f}, after {load_after[0]:.1f} "
      f"({os.cpu_count()} cores); {torch.get_num_threads()} torch threads, {device}")  # fmt: skip
figures["latency"].show()

# %% [markdown]
# How to read it, and why a CPU says something a GPU would not:
#
# * On a CPU a forward's time grows with the tokens it computes: the cores are busy with
#   arithmetic, whatever the batch. **naive** and **paged** compute the same tokens
#   (2144<!-- out -->), paged in fewer, fuller steps (21<!-- out --> against
#   29<!-- out -->), which saves only what every step costs besides arithmetic (Python,
#   waking the threads); on a quiet machine that is little, on a loaded one (a load
#   average above the cores) it is not, as every step also waits for the cores. On a GPU
#   a decode step reads every weight once, whatever the batch, so two sequences in one
#   step cost about what one does: that is where paging's extra concurrency turns into
#   throughput, and why it matters so much there.
# * **Prefix caching** skips the preamble's prefill, the largest share of this workload's
#   work (1232<!-- out --> tokens computed instead of 2144), so it saves time on any
#   machine.
# * **int8** saves memory, not arithmetic: in the torch path its codes are decoded before
#   attention, an extra step, so on a CPU it is no faster per token; its concurrency would
#   pay on a GPU, as paging's does.
# * **kernels** replace the torch attention with kvlab's native C code (notebook 06): the
#   same tokens as `paged+prefix`, computed by other code. Whether that is faster depends
#   on the CPU and the shapes (notebook 06): compare its row with `paged+prefix` above.
#
# > **Summary (the lesson).**
# > * A config name spells a design: a cache kind plus options, each setting
# >   `EngineConfig` fields; `Engine` builds the parts from them.
# > * Paging buys memory (waste only in each sequence's last block), prefix caching buys
# >   memory and skipped prefill, int8 buys nearly 4× the tokens per byte, kernels buy
# >   time.
# > * Concurrency is memory's dividend; whether it becomes throughput depends on the
# >   machine: on a CPU time follows the tokens computed, on a GPU a decode step costs
# >   about the same for many sequences as for one.
# > * None of these designs changes the greedy answer, except int8's rounding (rarely).
#
# ## Further
#
# Sections 5-8: a second sitting or homework.
#
# ## 5 · The full run, from the command line
#
# Sixteen doc-QA requests (every document once, the default answer lengths: 30 % of
# them 64-128 tokens) through the first four designs, with a budget of 4,096 token slots
# in fp32 (189 MB) and the default `max_model_len`, the longest request rounded up to
# 256 tokens (2,048). It takes minutes on a CPU, so it ran once from the CLI and its
# JSON is saved in `benchmarks/results/`:
#
# ```
# kvlab compare --workload doc-qa --n 16 --budget 4096tok --json > compare_doc_qa.unrecorded.json
# ```

# %%
saved = json.loads((RESULTS / "compare_doc_qa.unrecorded.json").read_text())
full = pd.DataFrame.from_dict(saved["configs"], orient="index")
print(full[["peak_concurrent", "waste_frac", "prefix_hit_rate", "output_tokens"]].to_string())
ratio = full.loc["paged+prefix+int8", "peak_concurrent"] / full.loc["naive", "peak_concurrent"]
print(f"peak concurrent sequences, paged+prefix+int8 / naive: {ratio:.1f}")

# %% [markdown]
# The same story at full size: paging doubles the naive cache's peak, the shared
# preamble adds one more, and with int8 all sixteen fit at once (**8.0**<!-- out -->× the
# naive peak). These are counts of the scheduler's decisions, the same on any machine.

# %% [markdown]
# ## 6 · Against what users would otherwise run: a saved run
#
# `kvlab bench` runs the same token-id prompts through kvlab, through transformers on the
# same model, and through vLLM:
#
# * **hf-generate**: `model.generate` in static, left-padded batches of 16 (or the
#   largest padded batch that fits the KV budget); a batch decodes until its longest
#   request is done;
# * **hf-generate-batch**: transformers' continuous batching (`generate_batch`'s manager)
#   with its own paged cache, given pages of its own (256 tokens) for every request at
#   once (`kvlab.peers.hf.pages_for_all`), so it is never held back by kvlab's budget;
# * **vllm**: vLLM's offline engine at its defaults, as its users run it: its model
#   compiled with torch.compile, its CPU build's block size (128), prefix caching on,
#   stats logging off, computing on both cores (`--vllm-threads 2`), in a process and venv
#   of its own (`make peers` builds `.venv-vllm`), given the same KV bytes. Its engine is
#   built (and compiled) once before the timed rounds; that time is reported apart.
#   "vllm (eager)" is the same engine without compiling.
#
# Greedy, each request's own `max_new_tokens`, EOS ignored, every system once untimed and
# then in 5 alternating rounds. The run below is the one `docs/design/benchmarks.md`
# quotes: 16 chat prompts × 64 new tokens (equal lengths: the case static batches handle
# best), kvlab `paged+prefix+kernels`, every peer at its defaults, on a quiet 2-core AMD
# EPYC with AVX-512. It is that run's machine and workload, not this notebook's: its
# figures are drawn alone, not beside the live runs above.

# %%
peers_run = BenchResult.load(RESULTS / "bench_uniform_chat_peers.avx512.json")
p = peers_run.provenance
print(f"{p['date']}, {p['machine']} ({p['cpu_flags']}); load average at start "
      f"{peers_run.meta['load_average_at_start'][0]}")  # fmt: skip
print(p["benchmark"])
for name in [k for k in peers_run.systems if k.startswith("vllm")]:
    vllm = peers_run.meta[name]
    print(f"  {name} {vllm['version']}: compiled {vllm['compiled']}, block {vllm['block_size']}, "
          f"engine built in {vllm['load_s']} s (not timed)")  # fmt: skip
print(peers_run.table().to_string())
medians = peers_run.median_ratios()
print("kvlab / peer, median rounds:", ", ".join(f"{k} {v:.3f}x" for k, v in medians.items()))
print("token agreement with kvlab:", peers_run.meta["token_agreement"])
peers_run.workload = "uniform chat, 16 x 64 tokens, AVX-512 EPYC (saved run)"
bench_figure(peers_run).show()

# %% [markdown]
# In this run, saved on 2026-12-06 before kvlab's own CPU linears and fused layer
# calls (section 6's next runs), **kvlab was behind vLLM at its defaults**: its median
# round delivered **0.927x**<!-- out --> vLLM's compiled throughput (ahead of vLLM run
# eagerly, 1.074x<!-- out -->, and of both HF paths, 2.075x<!-- out --> and
# 3.244x<!-- out -->). The workload is equal-length chat, where paging and prefix
# caching have little to save and every engine is bound by the same matrix products;
# kvlab's greedy tokens equal vLLM's on all 16 requests. HF's static batches shift the
# numerics (padding), so only 11 of 16 of its answers match (0.688<!-- out -->).

# %% [markdown]
# **With kvlab's own CPU kernels, fp32 and bf16, on both AVX-512 machines, and fp32 on an
# AVX2 one.** The Intel
# Xeon (AVX-512, AVX512-BF16 and AMX) runs bf16 matrix products on its AMX tiles, and so
# do kvlab's own kernels there: prompt attention (`kernels/cpu_amx.c`), a decode step's
# linear layers, streaming each weight once from a copy packed for the tile unit
# (`kernels/cpu_linear.c`), and cascade attention for decodes that share a long prefix
# (`kernels/cpu_cascade.py`). The AMD EPYC (AVX-512 and AVX512-BF16, no AMX) runs a bf16
# decode step's linears through the vector stream in pairs (`vdpbf16ps`) and its bf16
# prompts through the register tiles in pairs (`kernels/cpu_tiles.h`). On all three, fp32
# decode steps stream each weight once through the FMAs from a copy packed in panels
# (`kernels/cpu_stream.c`); in both dtypes a layer's norms, RoPE and SwiGLU take one call
# each (`kernels/cpu_fused.c`), and a decode step's layer two native calls around
# attention (`kernels/cpu_layer.c`). The same harness against vLLM compiled, both on the
# same two cores, saved runs:

# %%
for machine, suffix, cls in [("Xeon", {"fp32": "_xeon", "bf16": "_bf16"}, "avx512"),
                             ("EPYC", {"fp32": "_epyc", "bf16": "_bf16_epyc"}, "avx512"),
                             ("EPYC, AVX2", {"fp32": ""}, "avx2")]:  # fmt: skip
    runs = [
        ("uniform chat", "fp32", "bench_uniform_chat_vllm"),
        ("uniform chat", "bf16", "bench_uniform_chat_vllm"),
        ("doc-QA", "fp32", "bench_doc_qa_vllm"),
        ("doc-QA", "bf16", "bench_doc_qa_vllm"),
    ]
    if machine == "EPYC":  # doc-QA fp32 run twice there: vLLM ran slow in the first
        runs.append(("doc-QA, run again", "fp32", "bench_doc_qa_vllm_second"))
    for name, dtype, stem in [run for run in runs if run[1] in suffix]:  # the dtypes run
        run = BenchResult.load(RESULTS / f"{stem}{suffix[dtype]}.{cls}.json")
        rows, agree = run.table(), run.meta["token_agreement"]["vllm"]
        print(f"{machine}, {name}, {dtype}: kvlab {rows.loc['kvlab', 'median_tok_s']} tok/s, "
              f"vLLM {rows.loc['vllm', 'median_tok_s']} tok/s, "
              f"kvlab / vLLM {run.median_ratios()['kvlab/vllm']:.2f}x, "
              f"vLLM's tokens equal to kvlab's on {agree:.0%} of requests "
              f"({run.provenance['date']}, {run.provenance['machine']})")  # fmt: skip

# %% [markdown]
# On the Xeon kvlab is **ahead** of compiled vLLM on uniform chat in both dtypes: fp32
# (**1.48x**<!-- out -->) and bf16 (**1.40x**<!-- out -->), past the 1.2x issue 48 asks; on
# doc-QA it is ahead by less, in fp32 (**1.22x**<!-- out -->, just past 1.2x) and in
# bf16 (**1.04x**<!-- out -->, short of it). On the EPYC it is ahead on uniform chat, fp32
# (**1.48x**<!-- out -->) and bf16 (**1.72x**<!-- out -->), and on doc-QA in bf16
# (**1.25x**<!-- out -->). On doc-QA in fp32 the first run gave **1.21x**<!-- out -->, but
# vLLM ran slow in it (67.4<!-- out --> tok/s, against 80.4<!-- out --> in the run
# after it), and the same code run again gave **1.05x**<!-- out -->: there kvlab is ahead
# by about 5%, not by the 1.2x issue 48 asks. On the AMD EPYC with AVX2 (no AVX-512, no
# bf16 instructions), where the fp32 stream and the layer calls came last, kvlab is ahead
# in fp32 on uniform chat (**1.56x**<!-- out -->) and on doc-QA (**1.34x**<!-- out -->);
# bf16 was not run against vLLM there, since without bf16 instructions kvlab's bf16
# matrix products fall back to torch's slow ones. Each is
# one run's median of five rounds (the Xeon's rounds spread by at most 1.16). In fp32
# every token is equal; in bf16 each engine's rounding steers greedy
# answers apart after a few tokens. Doc-QA spends most of its time on prompts, whose fp32
# matrix products run near the CPU's peak in both engines, and on the Xeon in bf16 on
# attention (the prompts', and each decode's over its own document), the parts where
# kvlab is not yet faster than vLLM there. These are the runs `docs/design/benchmarks.md`
# quotes, with where each step's time goes.

# %% [markdown]
# ## 7 · A live check of the plumbing
#
# The same harness, live, on four chat prompts of four new tokens: kvlab and both HF
# paths, each run once (`warmup=False`: a warm-up pass only steadies timings, and nothing
# here is timed). It checks that every system runs and agrees on the greedy tokens; 16
# tokens are far too few to time, so no timings are compared. Set `LIVE_VLLM = True` to
# add vLLM where `make peers` has built it: eager and in one process, so it starts in
# tens of seconds on a 2-core CPU instead of the minutes that compiling its model takes.

# %%
LIVE_VLLM = False  # True: vLLM too, where `make peers` has built it (tens of s more)
missing = vllm_missing() if LIVE_VLLM else "LIVE_VLLM is False"
peers = DEFAULT_PEERS if missing else (*DEFAULT_PEERS, "vllm-eager")
live = run_bench(
    model,
    workloads.uniform_chat(4, max_new_tokens=4),
    peers=peers,
    rounds=1,
    warmup=False,
    workload="uniform chat x 4",
    vllm_inproc=True,
)
agree = live.meta["greedy_match_to_first_eos"]
for name in ("kvlab", *DEFAULT_PEERS):
    print(f"{name:18} {live.systems[name].output_tokens} tokens, agrees: {agree[name]}")

# %%
# NBVAL_IGNORE_OUTPUT
if missing:
    print(f"vLLM not run live here ({missing})")
else:
    eager = live.systems["vllm (eager)"]
    print(f"vllm (eager)       {eager.output_tokens} tokens, agrees: {agree['vllm (eager)']}")

# %% [markdown]
# ## 8 · The dashboard
#
# Everything in sections 2-4 in one app. Pick a workload, its number of requests, the KV
# budget (MiB) and any configs (including `paged+radix`, int4 and KIVI 2-bit KV), then
# press **Run**: the workload runs live through each config (in kvlab's default mode, as
# in section 3), and four panels redraw: memory over time, throughput, latency and peak
# concurrency. It opens on the run of section 3.

# %%
# NBVAL_IGNORE_OUTPUT
dash = Dashboard(
    model,
    workload="doc-qa",
    n=N,
    budget_mib=budget / 2**20,
    initial=result,
    workload_options={"doc-qa": {"seed": SEED, **ANSWERS}, "uniform-chat": {"max_new_tokens": 8}},
)
dash.widget()

# %% [markdown]
# Setting the widgets from code and pressing Run from code do what the mouse does. Four
# short chat prompts (8 new tokens each), 24 MiB, naive against paged+prefix+int8:

# %%
dash.workload.value, dash.n.value, dash.budget.value = "uniform-chat", 4, 24
dash.configs.value = ("naive", "paged+prefix+int8")
dash.run_button.click()
print({name: run.metrics["peak_concurrent"] for name, run in dash.result.runs.items()})
print(dash.status.value.split(";")[0])

# %% [markdown]
# > **Summary (further).**
# > * At full size the counts tell the same story: int8 with a shared preamble runs 8× the
# >   naive cache's sequences in the same bytes.
# > * Against vLLM at its defaults, on a quiet 2-core AVX-512 CPU, kvlab is behind
# >   (0.927× by median rounds) and ahead of HF `generate` and `generate_batch`; the greedy
# >   tokens agree with vLLM's.
# > * A saved run is another machine's and workload's figures: shown alone, named.
#
# ## What to try next
#
# * In the dashboard, lower the budget until the naive design fits one sequence, then
#   raise it until paging stops mattering: where do the designs converge?
# * Add `paged+radix` and `paged+prefix+kivi2`. kvlab's radix index matches token by
#   token and copies a partly matching block (its own design); SGLang's radix tree is
#   token-granular only at page size 1 and otherwise truncates a match to whole pages
#   (`page_align_keys` and `_key_match_paged` in
#   [radix_cache.py](https://github.com/sgl-project/sglang/blob/main/python/sglang/srt/mem_cache/radix_cache.py)).
# * `kvlab compare --configs paged,paged+reserve` compares admission policies: the
#   default admits more and preempts when blocks run out (`preemptions`); `reserve`
#   promises each request its worst case and never preempts.
# * `kvlab bench --workload chat --rounds 3 --save my_bench.json`, then
#   `Dashboard(model, bench="my_bench.json")` draws your machine's bars in grey beside the
#   live ones, its title naming that run. Add `--peers vllm` after `make peers`.
# * `python benchmarks/vllm_oracle.py` runs vLLM as the oracle of kvlab's accounting: KV
#   capacity for a byte budget, prefix-hit tokens per request, tokens.
# * Notebook 08 plans capacity for real models and accelerators from the same arithmetic.
#
# The stored timings come from the machine below (a shared 2-core CPU unless it says
# otherwise); yours will differ in scale. The printed counts are the same everywhere on
# CPU.

# %%
# NBVAL_IGNORE_OUTPUT
machine = platform.processor() or platform.machine()
print(f"{machine}, {os.cpu_count()} cores, torch on {torch.get_num_threads()} threads, {device}")
