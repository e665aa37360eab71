"""Experiments: the engine measured against itself, its variants and its peers.

Who uses it: the notebooks (each module names its notebook), the `kvlab compare`,
`kvlab bench` and `kvlab profile` commands, and the scripts in benchmarks/ that record
the same measurements. The systems kvlab is measured against are driven from
kvlab.peers; maintainers' checks against references live in kvlab.checks; config names
("paged+prefix+int8") are kvlab.presets. An experiment returns data (DataFrames,
dataclasses); its figures are drawn by kvlab.viz.

compare.py         one workload through several configs, same model and KV budget
metrics.py         the metrics of one run
bench.py           kvlab against HF transformers and vLLM on the same prompts
step_profile.py    where a step's time goes, part by part, and its floor (`kvlab profile`)
peer_profile.py    that profile beside vLLM's on the same tokens (`--peer vllm`)
why_cache.py       decoding with and without a KV cache (notebook 01)
fragmentation.py   reservation, internal and external fragmentation (notebook 02)
sharing.py         prefix sharing, hash vs radix, n > 1 forks (notebook 03)
quality.py         what a KV codec costs (perplexity, agreement) and buys (notebook 04)
stress.py          the scheduler under memory pressure (notebook 05)
capacity_check.py  the planner's prediction against a live run (notebook 08)
speculative.py     speculative decoding, kvlab beside HF and vLLM (notebook 09), with
                   spec_kvlab.py (kvlab's runs) and spec_runs.py (SpecRun, SpecResult)
tiers.py           the KV hierarchy on a multi-turn trace (notebook 10)
tier_decode.py     decode inter-token latency with KV on the device or in host memory
                   (notebook 10)
longctx.py         retention policies: needle recall, perplexity, KV held (notebook 11)
disagg.py          colocated vs disaggregated serving (notebook 12)
tensor_parallel.py per-rank KV, all-reduces, token identity (notebook 12)
isolation.py       the prefix-cache timing attack over HTTP (notebook 13)
determinism.py     why greedy decoding drifts with the batch (notebook 15)
scripts.py         what the command lines in benchmarks/ share (options, JSON output)
"""
