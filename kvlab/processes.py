"""How kvlab starts its worker processes (tensor-parallel ranks, the prefill engine).

A fresh process per worker, as spawn makes one, but forked from a server process that
has already imported torch, the worker's module and what loading a Llama-family
checkpoint imports from transformers (~3 s of a 4 s load_model on one core): a worker
starts and loads its model in under a second. The server is one per process and lives as
long as it does; it imports the modules named by the first caller. Where there is no
forkserver (macOS, Windows), spawn.
"""

from __future__ import annotations

import multiprocessing.context
import multiprocessing.process
import signal

import torch.multiprocessing as mp

START_METHOD = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
# What kvlab.model.loading.load_model imports on first use, for the embedded model
MODEL_MODULES = [
    "kvlab.model.loading",
    "transformers.models.auto.modeling_auto",
    "transformers.models.auto.tokenization_auto",
    "transformers.models.llama.modeling_llama",
]


def worker_context(preload: list[str]) -> multiprocessing.context.BaseContext:
    """The context to make worker processes with; `preload`: the worker's modules, which
    the fork server imports with MODEL_MODULES before it forks the first worker (ignored
    once the server runs)."""
    context = mp.get_context(START_METHOD)
    if START_METHOD == "forkserver":
        context.set_forkserver_preload([*preload, *MODEL_MODULES])
    return context


def exit_status(process: multiprocessing.process.BaseProcess) -> str:
    """How a worker process ended, for an error message: "killed by SIGKILL", "exit code 1"."""
    code = process.exitcode
    if code is None:
        return "still running"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"
