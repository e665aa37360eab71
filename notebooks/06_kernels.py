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
# # 06 · Kernels: paged decode attention, KV writes, fused dequantization
#
# *Engine files shown here:* `kernels/decode_attention.py`, `kernels/cache_write.py`,
# `kernels/kv_codes.py`, `kernels/dispatch.py`, `kvlab/model/kernel_attention.py`.
#
# *Lesson plan (50 min):* sections 1-4 with their three "check yourself" cells; on a
# GPU, section 4 measures the kernel live instead of the CPU's reference.
#
# Every decode step reads **the whole KV cache** of every running sequence to produce one
# token per sequence. That makes decode attention *memory-bound*: its speed is the speed
# at which K and V come out of memory. Serving engines therefore write their own kernels
# that read K/V **straight through the block table** (no gathered copy), write new K/V
# (quantizing them on the way), and **dequantize inside the kernel** (no dequantized copy).
#
# kvlab's kernels live in `kvlab.kernels` (the repo's `kernels/` folder), each beside a
# plain-torch reference with the same signature:
#
# * `paged_decode_attention_triton` (reference `paged_decode_attention_ref`): one query
#   token per sequence, GQA, the block table walk, split-K, int8/fp8 dequantized inside;
# * `kv_write_triton` (reference `kv_write_ref`): scatter the new K/V into their slots,
#   quantizing to int8/fp8 exactly as `kvlab.cache.codecs` does.
#
# `paged_decode_attention` and `kv_write` dispatch (`kernels/dispatch.py`): Triton on
# CUDA; on a CPU, kvlab's native C decode kernel (`kernels/cpu_decode.c`, built where a C
# compiler is found; it reads float K/V) and the torch reference otherwise (scaled codecs
# such as int8, and every K/V write). `backend="triton"` forces the Triton kernel: on a
# CPU it then runs under **Triton's interpreter** (numpy, slow), which must be switched on
# before triton is first imported: the set-up cell does that when there is no GPU. This
# notebook checks the Triton kernels against their references that way.

# %%
import json
import os
import platform
from pathlib import Path

import torch

device = "cuda" if torch.cuda.is_available() else "cpu"
if device == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before the first `import triton`

import pandas as pd  # noqa: E402
import plotly.io as pio  # noqa: E402
from kvlab.kernels import bench  # noqa: E402
from kvlab.kernels.decode_attention import _decode_kernel  # noqa: E402

import kvlab  # noqa: E402
from kvlab import kernels  # noqa: E402
from kvlab.course import ask, show_source  # noqa: E402
from kvlab.model.kernel_attention import KernelAttention  # noqa: E402
from kvlab.viz.kernels import block_walk_figure, roofline_figure  # noqa: E402

pio.renderers.default = "plotly_mimetype"
torch.manual_seed(0)
model = kvlab.load_model(device=device, progress=False)
print(f"device: {device}, kernels run {'compiled' if device == 'cuda' else 'interpreted'}")

# %% [markdown]
# ## 1 · Why decode is memory-bound
#
# One decode step of one attention layer, for one sequence with a context of *n* tokens:
# each of the `heads` query vectors takes a dot product with *n* keys, and a weighted sum
# of *n* values: about 4 · heads · head_dim · n floating-point operations. It must read
# the *n* keys and values: 2 · kv_heads · head_dim · n elements. For SmolLM2-135M
# (9 query heads, 3 kv heads, head_dim 64) in bf16 that is:

# %%
cfg = model.config
heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
head_dim = cfg.hidden_size // heads
flops_per_token = 4 * heads * head_dim
bytes_per_token = 2 * kv_heads * head_dim * 2  # K and V, bf16
print(f"{flops_per_token} FLOP per context token, {bytes_per_token} bytes per context token")
print(f"arithmetic intensity: {flops_per_token / bytes_per_token:.1f} FLOP/byte")

# %% [markdown]
# A GPU like the H200 does ~200 bf16 FLOP in the time it reads one byte from memory, so
# at 3.0<!-- out --> FLOP/byte the arithmetic units idle and **bandwidth is the whole story**. The
# kernel's goal is to stream K/V at close to the memory's copy bandwidth. Halving the
# bytes per token (int8 or fp8 K/V plus a small scale) roughly halves decode attention's
# time, if the dequantization happens inside the kernel and not in a separate pass.
#
# **Check yourself.** With int8 K/V (1 byte per element, plus a 2-byte bf16 scale per
# token per KV head, for K and for V), what is the arithmetic intensity in FLOP per byte?
# Write a line of Python from `heads`, `kv_heads` and `head_dim`.

# %%
my_int8_intensity = None  # your answer: FLOP per byte, or a line of Python computing it
ask("06.int8-intensity", my_int8_intensity, heads=heads, kv_heads=kv_heads, head_dim=head_dim)

# %% [markdown]
# ## 2 · How the kernel walks the block table
#
# The paged cache (notebook 02) scatters a sequence's tokens over fixed-size blocks of a
# shared pool, in whatever order the allocator handed them out. The kernel never gathers
# them into a contiguous copy: each program (one per **sequence × kv head × split**)
# steps through its part of the context in **tiles** of positions, and for each position
# *p* looks up its **physical block** in the sequence's block table and the **slot** (the
# row of the pool) it loads. The torch reference does the same arithmetic for every
# position at once (it then gathers the slots into a dense copy, which the kernel never
# makes):

# %%
show_source(kernels.paged_decode_attention_ref, "pos = torch.arange", "slots = torch.where")

# %% [markdown]
# `kernels.walk` is that arithmetic in plain Python, one row per position. Below: two
# sequences with 10 and 6 tokens (block tables `[5, 2, 7]` and `[1, 6]`), blocks of 4
# slots, tiles of 4 positions, and the context cut into 2 splits (the split-K trick
# below). Sequence 0's rows:

# %%
tables, lens = [[5, 2, 7], [1, 6]], [10, 6]
walked = pd.DataFrame(kernels.walk(tables, lens, block_size=4, tile=4, num_splits=2))
print(walked[walked.seq == 0].to_string(index=False))

# %% [markdown]
# **Check yourself.** Now sequence 1 (block table `[1, 6]`, 6 tokens): fill in the slot
# the kernel reads for each of its positions 0-5, as a list, before the figure shows it.

# %%
my_slots = None  # your answer: a list of 6 slot numbers
ask("06.slots", my_slots, tables=tables, lens=lens, block_size=4)

# %%
block_walk_figure(tables, lens, block_size=4, tile=4, num_splits=2, num_blocks=8)

# %% [markdown]
# In the top panel each square is one position of a sequence's context, labelled with the
# physical block it is read from (odd tiles drawn lighter; the dashed line is where the
# second split's program takes over). The bottom panel is the pool itself: sequence 0's
# positions 0-3 sit in block 5, 4-7 in block 2, 8-9 in the first half of block 7. The
# last block is partly filled: the kernel masks positions past the context length, so the
# empty slots are never read. Blocks 0, 3 and 4 belong to nobody.
#
# The kernel's loop over its tiles is the whole algorithm: the block table walk (the
# first four lines), the scores against K, the online softmax (`m`, `alpha`, `total`) and
# the weighted sum of V, with int8/fp8 scales multiplied into the scores and the
# probabilities (`_load_factor`). From kvlab's Triton source:

# %%
show_source(_decode_kernel.fn, "for tile_start in range", "m = m_new")

# %% [markdown]
# Three more ideas make the kernel fast, all in `kernels/decode_attention.py`:
#
# * **GQA**: the program for kv head *h* serves all `heads // kv_heads` query heads that
#   share it, so each K/V tile is loaded once and used 3 times (SmolLM2).
# * **Online softmax**: scores are never stored; a running max and sum rescale the
#   partial output tile by tile (the recurrence of
#   [FlashAttention](https://arxiv.org/abs/2205.14135)).
# * **Split-K** ([Flash-Decoding](https://crfm.stanford.edu/2023/10/12/flashdecoding.html)):
#   with few sequences, B × kv_heads programs cannot fill a GPU; cutting each context
#   into `num_splits` chunks gives more programs, each writing a partial output and its
#   log-sum-exp, merged by a small second kernel.

# %% [markdown]
# ## 3 · Kernel = reference, for every codec
#
# A small paged pool (ragged contexts 5, 13 and 8 over blocks of 4; 4 query heads over 2
# kv heads) is written **by the Triton KV-write kernel** and by the torch reference, for
# the model's dtype, int8 and both fp8 formats. The writes must agree bit for bit (codes
# and bf16 scales: the same layout as `kvlab.cache.codecs`). Then decode attention runs
# through the kernel (1 split and 2 splits) and the reference.


# %%
def kernel_vs_reference(kv_codec, lens=(5, 13, 8), shape=(4, 2, 16), block_size=4):
    args = bench.decode_inputs(list(lens), shape, kv_codec, torch.float32, device, block_size)
    q, kc, vc, tables, ctx, scale, bs, ks, vs, _ = args
    # Re-write the pool with the Triton kernel; it must equal the reference's bytes.
    g = torch.Generator(device=device).manual_seed(1)
    k, v = (torch.randn(kc.shape, generator=g, device=device) for _ in range(2))
    slots = torch.arange(kc.shape[0], device=device)
    ref_pool = [torch.empty_like(t) for t in (kc, vc, ks, vs)]
    kernels.kv_write_ref(k, v, ref_pool[0], ref_pool[1], slots, *ref_pool[2:], kv_codec)
    kernels.kv_write_triton(k, v, kc, vc, slots, ks, vs, kv_codec)
    compared = 4 if kv_codec in kernels.SCALED else 2  # codes (and their scales)
    written = (kc, vc, ks, vs)[:compared]
    same = all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(written, ref_pool)
    )
    ref = kernels.paged_decode_attention_ref(*args)
    errors = {
        f"max |kernel - ref|, {n} split{'s' * (n > 1)}": (
            kernels.paged_decode_attention_triton(*args, n, tile=16) - ref
        )
        .abs()
        .max()
        .item()
        for n in (1, 2)
    }
    return {"kv_codec": kv_codec or "model dtype (fp32)", "write bitwise equal": same, **errors}


checks = pd.DataFrame([kernel_vs_reference(c) for c in (None, "int8", "fp8_e4m3", "fp8_e5m2")])
print(checks[["kv_codec", "write bitwise equal"]].to_string(index=False))
error_columns = [c for c in checks.columns if c.startswith("max")]
print("every attention error below 1e-5:", bool((checks[error_columns] < 1e-5).all().all()))

# %%
# NBVAL_IGNORE_OUTPUT
print(checks.to_string(index=False))

# %% [markdown]
# The errors are float rounding, ~1e-7: the kernel sums in a different order (tile by
# tile, split by split) and, for int8/fp8, multiplies each token's scale into its score
# (K) or probability (V) instead of into every element, but it reads the very same codes.
#
# **On the real model.** `KernelAttention` is an `attention_fn` for kvlab's model runner:
# decode steps go through `paged_decode_attention`, prefill stays on the torch path. The
# block table is read off the step's metadata. Below, SmolLM2 with **int8 K/V**: the
# kernel reads the int8 codes and their scales straight from the pool, and greedy
# decoding gives the same tokens as the torch path, which dequantizes a gathered copy.
# (On a CPU every kernel call, one per layer per decode step, runs in Triton's numpy
# interpreter: hence only 4 new tokens.)

# %%
prompt, params = "What is the capital of France?", kvlab.SamplingParams(max_new_tokens=4)
for kv_codec in ("int8",):  # add None or "fp8_e4m3" (each costs ~20 s on a CPU)
    outputs = {}
    for path in ("torch", "kernel"):
        config = kvlab.EngineConfig(
            cache="paged", block_size=16, max_model_len=256, kv_budget_tokens=512, kv_codec=kv_codec
        )
        engine = kvlab.Engine(model, config)
        if path == "kernel":
            attention = KernelAttention(engine.cache.block_size, backend="triton")
            engine.runner.use_attention(attention)
        [out] = engine.generate([prompt], params)
        outputs[path] = out.token_ids
    print(
        f"kv_codec={kv_codec}: {model.tokenizer.decode(outputs['kernel'])!r}, "
        f"same tokens as torch: {outputs['kernel'] == outputs['torch']}, "
        f"kernel calls: {attention.decode_calls}"
    )

# %% [markdown]
# ## 4 · A roofline: bytes moved against time
#
# If decode attention runs at the memory's speed, its time is *bytes / bandwidth*: on a
# log-log plot of time against the bytes a call must read, the points sit on a line of
# slope 1, the **copy-bandwidth roofline** (measured by copying a large tensor). Points
# above the line are slower than memory allows; small calls sit furthest above it,
# because a fixed cost per call (a kernel launch on a GPU, torch's dispatch of each op on
# a CPU) outweighs their few bytes.
#
# On a GPU this cell measures the Triton kernel live (SmolLM2's layer shape, bf16, and
# int8 K/V). Without one it plots the results `benchmarks/gpu_check.py` committed from a
# GPU run, if there are any; otherwise it measures the CPU's torch reference (what a CPU
# runs for int8 K/V; for float K/V kvlab runs its native C kernel, `kvlab profile`
# measures it).

# %%
# NBVAL_IGNORE_OUTPUT
results = Path(kvlab.__file__).parents[1] / "benchmarks" / "results" / "gpu_check.json"
shape = (heads, kv_heads, head_dim)
if device == "cuda":
    copy = bench.copy_bandwidth(device, 1 << 30)
    rows = []
    for kv_codec in (None, "int8"):
        for context in (512, 2048, 8192):
            for batch in (1, 8, 32):
                args = bench.decode_inputs(
                    [context] * batch, shape, kv_codec, torch.bfloat16, device
                )
                ms = bench.bench_ms(
                    lambda a=args: kernels.paged_decode_attention_triton(*a), device
                )
                rows.append(
                    dict(
                        series=f"Triton {kv_codec or 'bf16'}",
                        bytes=bench.bytes_moved(args),
                        ms=ms,
                        context=context,
                        batch=batch,
                    )
                )
    points, title = pd.DataFrame(rows), f"decode kernel, live on {torch.cuda.get_device_name()}"
elif results.exists():
    saved = json.loads(results.read_text())
    copy = saved["copy_bandwidth"]
    rows = [
        dict(
            series=f"{r['shape']} {r['kv_codec']}",
            bytes=r["bytes"],
            ms=r["tuned_ms"],
            context=r["context"],
            batch=r["batch"],
        )
        for r in saved["bandwidth"]
        if "tuned_ms" in r
    ]
    points = pd.DataFrame(rows)
    title = f"decode kernel on {saved['device']} ({saved['date'][:10]}, committed results)"
else:
    print("No GPU here, and no GPU result is committed yet (benchmarks/results/gpu_check.json):")
    print("plotting the CPU's torch reference, measured now, instead of the Triton kernel.")
    copy = bench.copy_bandwidth(device, 64 << 20, reps=5)
    rows = []
    for kv_codec in (None, "int8"):
        for context in (256, 1024, 4096):
            for batch in (1, 4):
                args = bench.decode_inputs(
                    [context] * batch, shape, kv_codec, torch.float32, device
                )
                ms = bench.bench_ms(
                    lambda a=args: kernels.paged_decode_attention_ref(*a), device, 5
                )
                rows.append(
                    dict(
                        series=f"torch reference, {kv_codec or 'fp32'} K/V",
                        bytes=bench.bytes_moved(args),
                        ms=ms,
                        context=context,
                        batch=batch,
                    )
                )
    points, title = pd.DataFrame(rows), "decode attention's torch reference, live on this CPU"
points = points.assign(frac_of_copy=points["bytes"] / points["ms"] / 1e6 / copy["gb_s"])
print(f"copy bandwidth: {copy['gb_s']:.2f} GB/s (bytes read + written by one large copy)")
roofline_figure(points, copy["gb_s"], title)

# %% [markdown]
# The roofline is only as good as the copy bandwidth under it, and that figure belongs to
# the machine and the moment: how many memory channels the CPU (or the VM's share of it)
# has, how many threads the copy uses, and what else competes for the memory bus while it
# runs. The stored run measured 39.64<!-- out --> GB/s on a 2-core VM (AMD EPYC; its
# load average, printed at the end of this notebook, was about 1.6). Earlier runs of this notebook
# on 2-core VMs of the same kind, while other jobs kept them busy, measured a quarter of
# that and less, and every "fraction of the copy bandwidth" below moves with it. Quote a
# roofline with its machine and its load. Three more copies now, to see how much the
# figure varies from one moment to the next:

# %%
# NBVAL_IGNORE_OUTPUT
if device == "cpu":
    again = [bench.copy_bandwidth(device, 64 << 20, reps=5)["gb_s"] for _ in range(3)]
    print("copy bandwidth, three more measurements:", ", ".join(f"{x:.2f}" for x in again))

# %% [markdown]
# **Check yourself.** The largest call measured above (context and batch printed below)
# must read `bytes_read` bytes. At the copy bandwidth the roofline uses, what is the least
# time it can take, in ms?

# %%
# NBVAL_IGNORE_OUTPUT
largest = points.loc[points["bytes"].idxmax()]
bytes_read, copy_gb_s = int(largest["bytes"]), copy["gb_s"]
print(f"{largest['series']}, context {largest['context']}, batch {largest['batch']}: "
      f"{bytes_read:,} bytes, {copy_gb_s:.2f} GB/s")  # fmt: skip

# %%
my_least_ms = None  # your answer in ms, or a line of Python computing it
ask("06.least-time", my_least_ms, bytes_read=bytes_read, copy_gb_s=copy_gb_s)

# %% [markdown]
# The fraction of the copy bandwidth each point reaches (1.0 = on the roofline):

# %%
# NBVAL_IGNORE_OUTPUT
fractions = points.pivot_table(index=["series", "context"], columns="batch", values="frac_of_copy")
print(fractions.round(2).to_string())
print(f"best fraction of the copy bandwidth: {points['frac_of_copy'].max():.2f}")

# %% [markdown]
# On a CPU the reference's points sit far above the roofline, at a few hundredths of
# the copy bandwidth at best (the best fraction is printed above): it gathers K/V into a
# dense copy, dequantizes it into yet another copy, and makes the fp32 softmax tensors,
# so it moves several times the bytes counted here, and each call pays torch's fixed
# cost per op. The Triton kernel reads each byte once; on a GPU (run
# `python benchmarks/gpu_check.py`) large batches and long contexts should get close to
# the line, and int8/fp8 K/V should halve the time of bf16 at the same context.

# %% [markdown]
# > **Summary.**
# > * Decode attention reads every cached K/V byte once per step for a few FLOP per byte
# >   (3 in bf16, under 6 with int8): it is memory-bound, and its speed limit is the
# >   memory's copy bandwidth.
# > * The kernel walks the block table itself: position *p* reads slot
# >   `table[p // block_size] * block_size + p % block_size`, with no gathered copy; GQA,
# >   online softmax and split-K make each byte count once.
# > * int8/fp8 codes are read as they are stored and their scales multiplied into scores
# >   and probabilities: no dequantized copy, and the same tokens as the torch path.
# > * A roofline is relative to the copy bandwidth measured under it, which depends on
# >   the machine and on what else runs: quote it with both.
#
# ## What to try next
#
# * `kernels.walk(tables, lens, block_size, tile, num_splits)` with your own block tables
#   and `block_walk_figure` to see which program reads which slot; try `num_splits=3`.
# * Change `tile=16` in `kernel_vs_reference` to 32 or 64: the result must not change.
# * Read `kernels/decode_attention.py`: the loop body is the whole algorithm (block table
#   walk, scores, online softmax, weighted sum of V) in ~25 lines.
# * On a GPU, `python benchmarks/gpu_check.py` measures the kernel's bandwidth against the
#   copy bandwidth over context lengths and batch sizes, and the engine against HF
#   `generate`; its JSON lands in `benchmarks/results/`, where this notebook picks it up.
#
# The stored outputs of this notebook come from the machine below (a 2-core CPU unless it
# says otherwise), with its load average when the run ended.

# %%
# NBVAL_IGNORE_OUTPUT
machine = platform.processor() or platform.machine()
print(f"{machine}, {os.cpu_count()} cores, torch on {torch.get_num_threads()} threads, {device}")
print("load average (1, 5, 15 min):", ", ".join(f"{x:.2f}" for x in os.getloadavg()))
