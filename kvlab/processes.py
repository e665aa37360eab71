"""How kvlab starts its worker processes (tensor-parallel ranks, the prefill engine).

A fresh process per worker, as spawn makes one, but forked from a server process that
has already imported torch, transformers and the worker's module: a worker starts in
about half the time (tensor parallel at tp = 9 on 2 cores: 16 s instead of 23). The
server is one per process and lives as long as it does; it imports the modules named by
the first caller. Where there is no forkserver (macOS, Windows), spawn.
"""

from __future__ import annotations

import multiprocessing.context

import torch.multiprocessing as mp

START_METHOD = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"


def worker_context(preload: list[str]) -> multiprocessing.context.BaseContext:
    """The context to make worker processes with; `preload`: the modules the fork server
    imports before it forks the first worker (ignored once the server runs)."""
    context = mp.get_context(START_METHOD)
    if START_METHOD == "forkserver":
        context.set_forkserver_preload(preload)
    return context
