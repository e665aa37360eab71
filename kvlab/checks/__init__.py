"""Checks: kvlab verified against references and timed, for whoever maintains it.

Who uses it: the scripts in benchmarks/ that a maintainer runs on a new machine or a
lent GPU (benchmarks/gpu_check.py, cpu_kernels.py, vllm_oracle.py) and the tests; no
notebook. Each compares a part of kvlab with a reference that is not kvlab's own:
a kernel with its torch reference, kvlab's accounting with vLLM's.

kernel_check.py  every Triton kernel against its torch reference; copy bandwidth, the
                 decode kernel's tuning and achieved bandwidth
gpu_check.py     the GPU check's report: kernel_check and the engine against HF generate
cpu_kernels.py   the native CPU attention kernels against torch, on one model's shapes
vllm_oracle.py   vLLM as the oracle of kvlab's accounting: KV capacity for a byte budget,
                 per-request prefix hits, same model, token ids and block size
"""
