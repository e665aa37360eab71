"""vLLM as a peer of `kvlab bench`: one engine, built before the timed rounds.

    side = VllmBenchSide.start(model, prompts, max_new_tokens, budget_bytes,
                               eager=False, block_size=None)  # vLLM's own defaults
    run = side.run(prompts, max_new_tokens)  # a VllmRun: outputs, run_s, cpu_s
    side.meta()  # load time, compiled or eager, thread binding, KV shape; side.close()
    side.name  # "vllm" at its defaults, else how it ran: "vllm (eager, block 32)"

vLLM runs in its own process (`.venv-vllm`, see kvlab.peers.vllm_peer) in its
default multiprocess mode, as `vllm.LLM` runs: front end, engine core and model worker.
Its engine is built once; its load time (processes, weights, KV, and with eager=False
the torch.compile of its model) is reported apart and each round times generation
only, greedy, EOS ignored, prefix caching on, the prefix cache emptied before every
round (a fresh engine's state, as kvlab's Engine starts).

`kvlab bench` runs it at vLLM's defaults: compiled (eager=False) and its CPU build's
block size (block_size=None: 128), or eager as a labelled second peer ("vllm (eager)").
The defaults of `start` (eager, block 32) are the step-exact comparison's
(`kvlab profile --peer vllm`): the CPU build takes block sizes that are multiples of 32.
Its name in results says how it ran wherever that is not vLLM's default
(`vllm_system_name`). Stats logging stays off (`vllm.LLM`'s default) unless `stats=True`:
the profile's untimed run turns it on for its per-step rows.

Its KV gets `kv_bytes` (the bench's byte budget, or the whole workload at vLLM's block
size). vLLM refuses to start unless one `max_model_len` sequence fits beside its null
block, so its max_model_len is the longest request rounded up to a block, and the budget
is raised to that one sequence when smaller (meta says so).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.model.loading import LoadedModel
from kvlab.peers.vllm_peer import (
    VLLM_BLOCK_SIZE,
    VLLM_CPU_DEFAULT_BLOCK_SIZE,
    VllmEngine,
    VllmPeer,
    VllmRun,
    vllm_engine_args,
    vllm_system_name,
)
from kvlab.presets import model_bytes_per_token
from kvlab.units import round_up

MULTIPROCESS = "multiprocess (front end, engine core, model worker)"  # vLLM's default


@dataclass
class VllmBenchSide:
    """The started vLLM peer of one bench."""

    peer: VllmPeer
    engine: VllmEngine
    engine_args: dict
    budget_raised: bool  # the bench's budget could not hold one max_model_len sequence
    name: str = "vllm"  # vllm_system_name: "vllm" at its defaults, "vllm (eager)", ...
    stats: bool = False  # vLLM's stats logging (off: vllm.LLM's default)

    @classmethod
    def start(
        cls,
        model: LoadedModel,
        prompts: list[list[int]],
        max_new_tokens: list[int],
        budget_bytes: int,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 4096,
        threads: int | None = None,
        inproc: bool = False,
        *,
        eager: bool = True,
        block_size: int | None = VLLM_BLOCK_SIZE,
        stats: bool = False,
    ) -> VllmBenchSide:
        """Start the worker and build vLLM's engine for this workload (not timed).

        threads: None for vLLM's own binding ("auto": its model worker's OpenMP threads
        on all cores of a NUMA node but one, kept for its engine core), else N for
        VLLM_CPU_OMP_THREADS_BIND=0-(N-1).
        inproc: the whole engine in the worker process (what a profile needs).
        eager: enforce_eager (no torch.compile); False is vLLM's default.
        block_size: None for vLLM's own (128 on its CPU build).
        stats: vLLM's stats logging on (per-step rows: an untimed profile); off for
        timed runs, as `vllm.LLM` runs.
        """
        block = block_size or VLLM_CPU_DEFAULT_BLOCK_SIZE
        longest = max(len(p) + n for p, n in zip(prompts, max_new_tokens))
        max_model_len = round_up(longest, block)
        one_sequence = (max_model_len + block) * model_bytes_per_token(model)  # + null block
        kv_bytes = max(budget_bytes, one_sequence)
        args = vllm_engine_args(
            model,
            kv_bytes,
            max_model_len,
            block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enforce_eager=eager,
        )
        peer = VllmPeer(threads=threads, inproc=inproc)
        try:
            engine = peer.start(args, stats=stats)
        except BaseException:
            peer.close()
            raise
        name = vllm_system_name(eager, block_size)
        return cls(peer, engine, args, kv_bytes > budget_bytes, name, stats)

    def run(
        self, prompts: list[list[int]], max_new_tokens: list[int], profile: bool = False
    ) -> VllmRun:
        """All requests at once, greedy, exact lengths, from an empty prefix cache;
        profile: with torch's profiler (a side started with inproc=True)."""
        return self.peer.run(
            prompts, max_new_tokens, arrival="together", reset_prefix_cache=True, profile=profile
        )

    @property
    def pid(self) -> int:
        """The worker's process id (its engine core and model worker are its children)."""
        return self.peer.process.pid

    def meta(self) -> dict:
        """What the bench's meta records about vLLM."""
        return {
            "system": self.name,
            "version": self.engine.vllm_version,
            "load_s": round(self.engine.load_s, 2),
            "mode": "one process" if self.peer.inproc else MULTIPROCESS,
            "compiled": not self.engine_args["enforce_eager"],  # torch.compile (inductor)
            "compilation_mode": self.engine.compilation_mode,
            "block_size_chosen_by": "kvlab" if "block_size" in self.engine_args else "vLLM",
            "VLLM_CPU_OMP_THREADS_BIND": self.peer.threads_bind,
            "omp_core_ids": self.engine.omp_core_ids,
            "dtype": self.engine_args["dtype"],
            "block_size": self.engine.block_size,
            "kv_cache_memory_bytes": self.engine_args["kv_cache_memory_bytes"],
            "kv_budget_raised_to_one_sequence": self.budget_raised,
            "num_blocks": self.engine.num_blocks,
            "max_model_len": self.engine_args["max_model_len"],
            "max_num_batched_tokens": self.engine_args["max_num_batched_tokens"],
            "prefix_caching": self.engine_args["enable_prefix_caching"],
            "log_stats": self.stats,  # vLLM's stats logging (off: vllm.LLM's default)
        }

    def close(self) -> None:
        self.peer.close()
