"""vLLM's n-gram speculative decoding on kvlab's prompts: the peer's side of
kvlab.experiments.speculative (which turns its runs into SpecRuns).

vLLM runs in its own venv (kvlab.peers.vllm_peer), one engine (and worker process)
per k, each started with `speculative_config={"method": "ngram", "num_speculative_tokens":
k, "prompt_lookup_min": ..., "prompt_lookup_max": ...}` (k = 0: no speculation). Every prompt
runs alone (batch 1, "one-by-one"), greedy with EOS ignored, so each makes exactly its
max_new_tokens. Drafted and accepted tokens come from vLLM's own SpecDecodingStats; its
target forwards are its engine steps (one prefill step per prompt, then one forward per
step). vLLM times whole runs only.
"""

from __future__ import annotations

from kvlab.model.loading import LoadedModel
from kvlab.peers.vllm_peer import VllmPeer, VllmRun, vllm_engine_args


def ngram_config(k: int, lookup_min: int, lookup_max: int) -> dict | None:
    """vLLM's speculative_config for n-gram drafting of k tokens (None for k = 0)."""
    if not k:
        return None
    return {"method": "ngram", "num_speculative_tokens": k,
            "prompt_lookup_min": lookup_min, "prompt_lookup_max": lookup_max}  # fmt: skip


def run_vllm(
    model: LoadedModel,
    prompts: list[list[int]],
    max_new_tokens: list[int],
    ks: tuple[int, ...],
    lookup_min: int,
    lookup_max: int,
    threads: int | None = None,
    baseline: bool = True,
) -> dict[int, VllmRun]:
    """vLLM without speculation (k = 0, unless `baseline` is False) and with n-gram
    drafting at each k, batch 1 -> {k: its VllmRun}."""
    longest = max(map(len, prompts)) + max(max_new_tokens) + max((*ks, 0)) + 1
    runs = {}
    # A worker process per engine: vLLM's CPU build starts one engine per process cleanly
    # (one started after two others in a process failed rebinding its kernels).
    for k in ((0,) if baseline else ()) + tuple(ks):
        args = vllm_engine_args(model, kv_cache_bytes=2**28, max_model_len=longest)
        spec = ngram_config(k, lookup_min, lookup_max)
        with VllmPeer(threads=threads, inproc=True) as peer:
            peer.start(args | ({"speculative_config": spec} if spec else {}))
            runs[k] = peer.run(prompts, max_new_tokens, arrival="one-by-one")
    return runs
