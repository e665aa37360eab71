"""vLLM's n-gram speculative decoding on kvlab's prompts: the peer's side of
kvlab.experiments.speculative (which turns its runs into SpecRuns).

vLLM runs in its own venv (kvlab.peers.vllm_peer), eager at block size 32
(`vllm_engine_args`' defaults: an eager engine starts in seconds, and each k needs an
engine of its own; the results name it so, SYSTEM), one engine (and worker process) per
k, each started with `speculative_config={"method": "ngram", "num_speculative_tokens":
k, "prompt_lookup_min": ..., "prompt_lookup_max": ...}` (k = 0: no speculation). Every
prompt runs alone (batch 1), greedy with EOS ignored, so each makes exactly its
max_new_tokens, after an untimed warm-up (the first prompt, a few tokens), and from an
empty prefix cache: each timed prompt is prefilled inside its time, as HF's and kvlab's
are. Its target forwards are its engine steps (one prefill step per prompt, then one
forward per step). vLLM times whole runs only.

The timed runs leave vLLM's stats logging off (`vllm.LLM`'s default). Drafted and
accepted tokens come from vLLM's own SpecDecodingStats, which need it on: an untimed
counting pass, on an engine of its own with stats on, runs the same prompts (its tokens
must equal the timed run's).
"""

from __future__ import annotations

from kvlab.model.loading import LoadedModel
from kvlab.peers.vllm_peer import (
    VLLM_BLOCK_SIZE,
    VllmPeer,
    VllmRun,
    vllm_engine_args,
    vllm_system_name,
)

SYSTEM = vllm_system_name(eager=True, block_size=VLLM_BLOCK_SIZE)  # "vllm (eager, block 32)"
WARMUP_TOKENS = 4


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
    count_drafts: bool = True,
    timed: bool = True,
) -> dict[int, VllmRun]:
    """vLLM without speculation (k = 0, unless `baseline` is False) and with n-gram
    drafting at each k, batch 1 -> {k: its VllmRun}: the timed runs' tokens, seconds and
    steps, and (with `count_drafts`) the counting pass's drafted and accepted tokens.
    `timed=False` runs only the counting pass where k > 0 (its tokens, steps and drafts;
    its seconds are a stats-on run's, not a timing)."""
    longest = max(map(len, prompts)) + max(max_new_tokens) + max((*ks, 0)) + 1
    runs = {}
    # A worker process per engine: vLLM's CPU build starts one engine per process cleanly
    # (one started after two others in a process failed rebinding its kernels).
    for k in ((0,) if baseline else ()) + tuple(ks):
        args = vllm_engine_args(model, kv_cache_bytes=2**28, max_model_len=longest)
        spec = ngram_config(k, lookup_min, lookup_max)
        args |= {"speculative_config": spec} if spec else {}  # k = 0: none
        count = bool(spec) and (count_drafts or not timed)
        run = None
        if timed or not count:
            with VllmPeer(threads=threads, inproc=True) as peer:
                peer.start(args)  # stats off, as vllm.LLM runs
                peer.run(prompts[:1], [min(WARMUP_TOKENS, max_new_tokens[0])])  # untimed
                run = joined(one_by_one_cold(peer, prompts, max_new_tokens))
        if count:
            with VllmPeer(threads=threads, inproc=True) as peer:
                peer.start(args, stats=True)
                counted = joined(one_by_one_cold(peer, prompts, max_new_tokens))
            if run is not None and counted.outputs != run.outputs:
                raise RuntimeError(f"vLLM n-gram k={k}: the counting pass's tokens differ")
            run = counted if run is None else joined([run], counted)
        runs[k] = run
    return runs


def one_by_one_cold(
    peer: VllmPeer, prompts: list[list[int]], max_new_tokens: list[int]
) -> list[VllmRun]:
    """Each prompt alone, from an empty prefix cache (its prefill inside its time)."""
    return [peer.run([p], [n], reset_prefix_cache=True) for p, n in zip(prompts, max_new_tokens)]


def joined(runs: list[VllmRun], counts: VllmRun | None = None) -> VllmRun:
    """Runs one after another as one: outputs in order, seconds and steps summed;
    drafts, drafted and accepted from `counts` where given (a run with stats on)."""
    return VllmRun(
        outputs=[o for r in runs for o in r.outputs],
        num_cached_tokens=[c for r in runs for c in r.num_cached_tokens],
        num_preemptions=[c for r in runs for c in r.num_preemptions],
        run_s=sum(r.run_s for r in runs),
        cpu_s=sum(r.cpu_s for r in runs),
        steps=sum(r.steps for r in runs),
        peak_running=max(r.peak_running for r in runs),
        peak_waiting=max(r.peak_waiting for r in runs),
        preemptions=sum(r.preemptions for r in runs),
        drafts=counts.drafts if counts else sum(r.drafts for r in runs),
        drafted=counts.drafted if counts else sum(r.drafted for r in runs),
        accepted=counts.accepted if counts else sum(r.accepted for r in runs),
        step_rows=[row for r in runs for row in r.step_rows],
    )
