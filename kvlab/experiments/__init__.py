"""Experiments: the engine measured against itself, its variants and its peers.

compare.py         one workload through several configs, same model and KV budget
configs.py         config names ("paged+prefix+int8") and KV budgets ("64MiB")
metrics.py         the metrics of one run
bench.py           kvlab against HF transformers on the same prompts
peers.py           HF transformers `generate` and `generate_batch`
stress.py          the scheduler under memory pressure
sharing.py         prefix sharing, hash vs radix, n > 1 forks
quality.py         what a KV codec costs (perplexity, agreement) and buys (capacity)
why_cache.py       decoding with and without a KV cache
capacity_check.py  the planner's prediction against a live run
kernel_check.py    the Triton kernels against their references, and their bandwidth
gpu_check.py       the GPU check's report: kernel_check and the engine against HF generate
longctx.py         retention policies: needle recall, perplexity, KV held (long context)
scripts.py         what the command lines in benchmarks/ share (options, JSON output)
"""
