"""Process faults: a tensor-parallel rank or the prefill process killed (SIGKILL) mid-run.

Tensor parallel raises EngineDead naming the dead rank within seconds; disaggregated serving
prefills the lost prompts on the decode engine and carries on with the same greedy tokens.
Either way close() joins every worker: no process and no shared memory is left behind.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from pathlib import Path

import pytest

import kvlab
from kvlab import EngineConfig, SamplingParams
from kvlab.disagg import Disaggregated
from kvlab.integrity import EngineDead
from kvlab.workloads import Request

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], list(range(100, 140)), [3, 1, 4, 1, 5, 9, 2, 6], [42] * 21]
PARAMS = SamplingParams(max_new_tokens=8, ignore_eos=True)
CONFIG = dict(cache="paged", block_size=4, max_model_len=256)
SECONDS = 30  # "within seconds", with room for a loaded 2-core machine


@pytest.fixture(scope="module")
def expected(tiny_model) -> list[list[int]]:
    """The greedy tokens of one engine in this process, no fault."""
    engine = kvlab.Engine(tiny_model, EngineConfig(**CONFIG))
    return [out.token_ids for out in engine.generate(PROMPTS, PARAMS)]


def descendants() -> set[int]:
    """Pids of this process's descendants (zombies too), but multiprocessing's servers: the
    fork server (the workers are its children) and the resource tracker are children of
    this process that live as long as it does."""
    parent, command = {}, {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            stat = (proc / "stat").read_text()
            command[int(proc.name)] = (proc / "cmdline").read_bytes()
        except OSError:  # gone meanwhile
            continue
        parent[int(proc.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {os.getpid()}
    while frontier:
        frontier = {pid for pid, ppid in parent.items() if ppid in frontier} - found
        found |= frontier
    servers = {
        pid
        for pid in found
        if parent[pid] == os.getpid() and b"from multiprocessing." in command.get(pid, b"")
    }
    return found - servers


def shared_memory(pids: list[int]) -> list[str]:
    """torch's shared memory of `pids`: /dev/shm entries (torch_<pid>_...), and those this
    process still maps (a tensor received from a worker and never freed)."""
    names = tuple(f"torch_{pid}_" for pid in pids)
    named = [name for name in os.listdir("/dev/shm") if name.startswith(names)]
    maps = Path("/proc/self/maps").read_text().splitlines()
    return named + [line for line in maps if "/dev/shm/torch_" in line]


@pytest.fixture
def no_leftovers():
    """Checks that the test leaves no process and no shared memory behind; the test adds
    its workers' pids to the list it gets."""
    before, pids = descendants(), [os.getpid()]
    yield pids
    import gc

    gc.collect()
    assert descendants() <= before, "a worker process outlived close()"
    assert not shared_memory(pids), "shared memory outlived close()"


# --- tensor parallel -------------------------------------------------------------------------
def kill_before_all_reduce(monkeypatch, engine, victim, count: int) -> None:
    """SIGKILL `victim` as rank 0 enters its `count`-th all-reduce: the rank dies in the
    middle of a forward, with rank 0 about to wait on it."""
    runner = engine.runner
    reduce = runner.reduce

    def reduce_or_kill(partial):
        if runner.all_reduces + 1 == count:
            os.kill(victim.pid, signal.SIGKILL)
        return reduce(partial)

    monkeypatch.setattr(runner, "reduce", reduce_or_kill)


@pytest.mark.parametrize(
    "tp, rank, when",
    [(2, 1, "in an all-reduce"), (4, 2, "in an all-reduce"), (2, 1, "between steps")],
)
def test_a_killed_rank_raises_engine_dead_naming_it(
    tiny_model, expected, monkeypatch, no_leftovers, tp, rank, when
):
    engine = kvlab.Engine(tiny_model, EngineConfig(**CONFIG, tensor_parallel_size=tp))
    workers = list(engine.parallel.workers)
    no_leftovers += [w.pid for w in workers]
    victim = workers[rank - 1]
    for prompt in PROMPTS:
        engine.add_request(prompt, PARAMS)
    for _ in range(3):
        engine.step()
    layers = len(engine.runner.layers)
    if when == "between steps":
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(timeout=SECONDS)
    else:
        kill_before_all_reduce(monkeypatch, engine, victim, engine.runner.all_reduces + layers + 1)
    named = rf"rank {rank} \(pid {victim.pid}\) died \(killed by SIGKILL\)"
    started = time.monotonic()
    with pytest.raises(EngineDead, match=named) as died:
        engine.step()
    assert time.monotonic() - started < SECONDS
    assert len(engine.stats()) == 3 and engine.has_unfinished()  # it died mid-run
    assert not any(w.is_alive() for w in workers)  # the others are stopped with it
    if tp > 2:  # the other ranks fall with it: their collective broke
        with pytest.raises(EngineDead, match=r"; then rank 1 \(pid \d+, exit code 1\), rank 3"):
            engine.step()
    started = time.monotonic()
    with pytest.raises(EngineDead, match=named) as again:  # every later call
        engine.step()
    assert again.value is died.value  # the verdict kept, not a new wait on the ranks
    assert time.monotonic() - started < SECONDS  # liveness (no hang), not speed
    engine.close()
    engine.close()
    assert not os.path.exists(engine.parallel.store)
    again = kvlab.Engine(tiny_model, EngineConfig(**CONFIG, tensor_parallel_size=2))
    no_leftovers += [w.pid for w in again.parallel.workers]
    try:  # the process group is gone with the dead engine: a new one starts and serves
        assert again.generate(PROMPTS[:1], PARAMS)[0].token_ids == expected[0]
    finally:
        again.close()


def test_a_rank_that_cannot_load_its_model_fails_the_start(tiny_model, no_leftovers):
    """A worker that dies before the rendezvous ends the start at once, not after gloo's
    10-minute wait for it."""
    missing = dataclasses.replace(tiny_model, name="/nonexistent/model")
    started = time.monotonic()
    with pytest.raises(
        EngineDead, match=r"rank 1 \(pid \d+\) exited while loading the model \(exit code 1\)"
    ):
        kvlab.Engine(missing, EngineConfig(**CONFIG, tensor_parallel_size=2))
    assert time.monotonic() - started < SECONDS


# --- disaggregated -----------------------------------------------------------------------------
class KillingPipe:
    """The pipe to the prefill process; SIGKILLs the process right after the first batch of
    prompts is sent ("in flight") or the first transfer comes back ("after a transfer")."""

    def __init__(self, pair: Disaggregated, when: str):
        self.pair, self.conn, self.when = pair, pair.conn, when

    def __getattr__(self, name):
        return getattr(self.conn, name)

    def _kill(self) -> None:
        if self.pair.worker.is_alive():
            os.kill(self.pair.worker.pid, signal.SIGKILL)

    def send(self, message) -> None:
        self.conn.send(message)
        if self.when == "in flight":
            self._kill()

    def recv(self):
        message = self.conn.recv()
        if self.when == "after a transfer":
            self._kill()
        return message


@pytest.mark.parametrize("when", ["in flight", "after a transfer"])
def test_a_killed_prefill_process_is_recomputed_here(
    tiny_model, expected, monkeypatch, no_leftovers, when
):
    pair = Disaggregated(tiny_model, EngineConfig(**CONFIG), EngineConfig(**CONFIG))
    no_leftovers.append(pair.worker.pid)
    pid = pair.worker.pid
    monkeypatch.setattr(pair, "conn", KillingPipe(pair, when))
    # Later requests arrive after the kill: never sent, prefilled here at their arrival.
    requests = [Request(p, PARAMS.max_new_tokens, arrival_s=0.3 * i) for i, p in enumerate(PROMPTS)]
    started = time.monotonic()
    try:
        with pytest.warns(
            RuntimeWarning, match=rf"prefill process \(pid {pid}\) died \(killed by SIGKILL\)"
        ):
            outs = pair.run(requests, ignore_eos=True)
        assert time.monotonic() - started < SECONDS
        assert [o.token_ids for o in outs] == expected
        stats = pair.stats
        assert stats.prefilled_here + stats.transfers == len(PROMPTS)
        assert stats.prefilled_here >= len(PROMPTS) - 1  # at most one came back first
        assert pair.lost and not pair.worker.is_alive()
        # Later calls serve on the decode engine alone.
        assert [o.token_ids for o in pair.generate(PROMPTS, PARAMS)] == expected
        assert stats.prefilled_here >= 2 * len(PROMPTS) - 1
    finally:
        pair.close()
    pair.close()
    decode = pair.decode.cache
    decode.check_integrity()
    assert decode.num_available == decode.num_blocks and pair.prefill_blocks_held is None
    assert not pair.consumer.arrived


def test_a_prefill_process_dead_before_the_call(tiny_model, expected, no_leftovers):
    """A prefill process that died while the pair was idle: the next call sends to it, finds
    it dead, and serves every prompt here."""
    pair = Disaggregated(tiny_model, EngineConfig(**CONFIG), EngineConfig(**CONFIG))
    no_leftovers.append(pair.worker.pid)
    try:
        os.kill(pair.worker.pid, signal.SIGKILL)
        pair.worker.join(timeout=SECONDS)
        with pytest.warns(RuntimeWarning, match="killed by SIGKILL"):
            outs = pair.generate(PROMPTS, PARAMS)
        assert [o.token_ids for o in outs] == expected
        assert pair.stats.prefilled_here == len(PROMPTS) and pair.stats.transfers == 0
    finally:
        pair.close()
