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

A rank that dies (killed, or an error of its own) closes its TCP connections, and gloo
raises at once in every rank waiting on it ("Connection closed by peer"), measured for a
rank killed mid-all-reduce and between steps at tp 2 and 4; the workers exit with it, and
rank 0 raises EngineDead naming the dead rank. gloo's TIMEOUT only ends a wait on a rank
that is alive but stuck.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from datetime import timedelta
from multiprocessing.connection import wait

import torch
import torch.distributed as dist

from kvlab.cache.pool import KVPool
from kvlab.integrity import EngineDead
from kvlab.parallel.pool import DistributedPool
from kvlab.parallel.runner import ShardedRunner
from kvlab.processes import exit_status, worker_context

TIMEOUT = timedelta(minutes=10)


def _init(rank: int, tp: int, store: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=tp, timeout=TIMEOUT)  # fmt: skip


def _receive() -> tuple:
    message = [None]
    dist.broadcast_object_list(message, src=0)
    return message[0]


def worker_main(rank: int, tp: int, store: str, model_name: str | None, dtype, loaded) -> None:
    """Rank `rank`'s loop (in a worker process); it tells rank 0 over `loaded` (a pipe) once
    its model is loaded, before the rendezvous."""
    torch.set_num_threads(1)
    from kvlab.model.loading import load_model

    # The weights only: rank 0 tokenizes (a tokenizer is ~half of a worker's load time)
    model = load_model(model_name, device="cpu", dtype=dtype, progress=False, tokenizer=False)
    loaded.send(True)  # BrokenPipeError if rank 0 is gone: nobody to serve, exit
    loaded.close()
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
    """Rank 0's side: spawns the workers, sends them messages, stops them.

    Every collective runs inside `watch()`: when a rank dies, the gloo error becomes
    EngineDead naming the rank, its pid and how it ended, the other ranks are killed, and
    every later call raises the same error at once. `close()` joins every worker.
    """

    def __init__(self, model, tp: int):
        from kvlab.model.loading import EMBEDDED_MODEL

        if dist.is_initialized():
            raise ValueError(
                "a tensor-parallel engine is already running in this process: call its "
                "close() first (one process group per process)"
            )
        self.tp = tp
        self.dead: EngineDead | None = None  # set once a rank has died
        self.messages = 0  # messages sent to the workers
        handle, self.store = tempfile.mkstemp(prefix="kvlab-tp-")
        os.close(handle)
        os.unlink(self.store)  # the file store creates it
        name = None if model.name == EMBEDDED_MODEL else model.name
        context = worker_context(["kvlab.parallel.worker"])
        self.workers, readers = [], []
        for rank in range(1, tp):
            reader, writer = context.Pipe(duplex=False)
            worker = context.Process(
                target=worker_main,
                args=(rank, tp, self.store, name, model.hf_model.dtype, writer),
                daemon=True,
            )
            worker.start()
            writer.close()  # the worker's end: closed here, its death reads as EOF
            self.workers.append(worker)
            readers.append(reader)
        try:
            self._await_loaded(readers)
            _init(0, tp, self.store)
        except BaseException:  # a worker died, or the start was interrupted
            self._reap(timeout=0)
            self.close()
            raise
        self.runner = ShardedRunner(model.hf_model, 0, tp, leader=self)

    def _await_loaded(self, readers: list) -> None:
        """Wait until every worker has loaded its model; raise EngineDead as soon as one
        exits instead (the rendezvous would wait TIMEOUT for it)."""
        try:
            for rank, (reader, worker) in enumerate(zip(readers, self.workers), 1):
                try:
                    reader.recv()
                except EOFError:
                    worker.join(timeout=5)
                    self.dead = EngineDead(
                        f"tensor-parallel rank {rank} (pid {worker.pid}) exited while loading "
                        f"the model ({exit_status(worker)}): its error is printed above"
                    )
                    raise self.dead from None
        finally:
            for reader in readers:
                reader.close()

    @contextlib.contextmanager
    def watch(self):
        """Run collectives: an error because a rank died raises EngineDead naming it."""
        if self.dead is not None:
            raise self.dead
        try:
            yield
        except EngineDead:
            raise
        except RuntimeError as error:  # gloo: "Connection closed by peer ..."
            self.dead = self._death()
            if self.dead is None:  # every rank is alive: not a death
                raise
            self._reap(timeout=0)  # the ranks still alive wait for messages that never come
            raise self.dead from error

    def _death(self) -> EngineDead | None:
        """EngineDead naming the ranks that have died, or None if none dies within seconds.

        The one killed by a signal comes first; the others are ranks that raised when it
        broke their collective (exit code 1)."""
        if not wait([worker.sentinel for worker in self.workers], timeout=5):
            return None
        deadline = time.monotonic() + 3  # the ranks that fall with it (exit code 1)
        for worker in self.workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        dead = [(rank, w) for rank, w in enumerate(self.workers, 1) if w.exitcode is not None]
        dead.sort(key=lambda item: (item[1].exitcode >= 0, item[0]))
        (rank, worker), *others = dead
        message = f"tensor-parallel rank {rank} (pid {worker.pid}) died ({exit_status(worker)})"
        if others:
            message += "; then " + ", ".join(
                f"rank {r} (pid {w.pid}, {exit_status(w)})" for r, w in others
            )
        return EngineDead(f"{message}: the engine cannot go on; close() it and start a new one")

    def send(self, message: tuple) -> None:
        with self.watch():
            self.messages += 1
            dist.broadcast_object_list([message], src=0)

    def gather(self, mine) -> list:
        parts = [None] * self.tp
        with self.watch():
            dist.gather_object(mine, parts, dst=0)
        return parts

    def attach(self, pool: KVPool) -> DistributedPool:
        """Give every worker a pool like rank 0's; return rank 0's, mirrored."""
        self.send(("pool", pool.num_slots, pool.kv_codec))
        return DistributedPool(pool, self.send, self.gather)

    def _reap(self, timeout: float) -> None:
        """Join every worker, killing each one still alive `timeout` seconds on."""
        for worker in self.workers:
            worker.join(timeout)
            if worker.is_alive():
                worker.kill()
                worker.join()

    def close(self) -> None:
        """Stop the workers, leave the process group and remove its store (idempotent).
        After a rank died, the others are killed instead; every worker is joined."""
        if not self.workers:
            return
        if dist.is_initialized():
            if self.dead is None:
                with contextlib.suppress(RuntimeError):  # EngineDead: a rank died since
                    self.send(("stop",))
            dist.destroy_process_group()
        self._reap(timeout=30 if self.dead is None else 0)
        self.workers = []
        if os.path.exists(self.store):
            os.unlink(self.store)
