"""The worker processes of a tensor-parallel engine, and rank 0's handle on them.

Rank 0 (the engine's process) runs the scheduler and the cache; ranks 1 .. tp - 1 are
processes of their own (kvlab.processes) that load the same checkpoint, keep their slice
of the weights and their own KV pool, and loop: receive a message from rank 0, act on
it. Messages are Python objects broadcast over a gloo process group (CPU; NCCL would
carry the all-reduces on GPUs):

    ("pool", num_slots, kv_codec)        build this rank's pool
    ("forward", input_ids, meta, ...)    run the step's forward (joins the all-reduces)
    ("copy" | "poison" | "discard", ...) mirror a cache operation on the pool
    ("read", slots) / ("restore", ...)   swap-out (gathered to rank 0) / swap-in
    ("stop",)                            leave the group and exit
"""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist

from kvlab.cache.pool import KVPool
from kvlab.parallel.pool import DistributedPool
from kvlab.parallel.runner import ShardedRunner
from kvlab.processes import worker_context

TIMEOUT = timedelta(minutes=10)


def _init(rank: int, tp: int, store: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=tp, timeout=TIMEOUT)  # fmt: skip


def _receive() -> tuple:
    message = [None]
    dist.broadcast_object_list(message, src=0)
    return message[0]


def worker_main(rank: int, tp: int, store: str, model_name: str | None, dtype) -> None:
    """Rank `rank`'s loop (in a worker process)."""
    torch.set_num_threads(1)
    from kvlab.model.loading import load_model

    model = load_model(model_name, device="cpu", dtype=dtype, progress=False)
    _init(rank, tp, store)
    runner = ShardedRunner(model.hf_model, rank, tp)
    pool = None
    while True:
        kind, *args = _receive()
        if kind == "stop":
            break
        if kind == "pool":
            pool = KVPool(runner.kv_spec, args[0], runner.dtype, runner.device, args[1])
        elif kind == "forward":
            runner.forward(args[0], args[1], pool, *args[2:])
        elif kind == "read":
            dist.gather_object(pool.read(args[0]), None, dst=0)
        elif kind == "restore":
            pool.restore(args[0], args[1][rank])
        else:  # copy, poison, discard
            getattr(pool, kind)(*args)
    dist.destroy_process_group()


class TensorParallel:
    """Rank 0's side: spawns the workers, sends them messages, stops them."""

    def __init__(self, model, tp: int):
        from kvlab.model.loading import EMBEDDED_MODEL

        if dist.is_initialized():
            raise ValueError(
                "a tensor-parallel engine is already running in this process: call its "
                "close() first (one process group per process)"
            )
        self.tp = tp
        handle, self.store = tempfile.mkstemp(prefix="kvlab-tp-")
        os.close(handle)
        os.unlink(self.store)  # the file store creates it
        name = None if model.name == EMBEDDED_MODEL else model.name
        context = worker_context(["kvlab.parallel.worker"])
        self.workers = [
            context.Process(
                target=worker_main,
                args=(rank, tp, self.store, name, model.hf_model.dtype),
                daemon=True,
            )
            for rank in range(1, tp)
        ]
        for worker in self.workers:
            worker.start()
        _init(0, tp, self.store)
        self.runner = ShardedRunner(model.hf_model, 0, tp, broadcast=self.send)
        self.messages = 0  # messages sent to the workers

    def send(self, message: tuple) -> None:
        self.messages += 1
        dist.broadcast_object_list([message], src=0)

    def gather(self, mine) -> list:
        parts = [None] * self.tp
        dist.gather_object(mine, parts, dst=0)
        return parts

    def attach(self, pool: KVPool) -> DistributedPool:
        """Give every worker a pool like rank 0's; return rank 0's, mirrored."""
        self.send(("pool", pool.num_slots, pool.kv_codec))
        return DistributedPool(pool, self.send, self.gather)

    def close(self) -> None:
        """Stop the workers and leave the process group (idempotent)."""
        if not self.workers:
            return
        if dist.is_initialized():
            self.send(("stop",))
            dist.destroy_process_group()
        for worker in self.workers:
            worker.join(timeout=30)
            if worker.is_alive():
                worker.kill()
        self.workers = []
        if os.path.exists(self.store):
            os.unlink(self.store)
