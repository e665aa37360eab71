"""What offloading KV does to decode: inter-token latency (ITL) per decode step.

The same prompts decode on the same engine in three cases, each step timed from outside
`engine.step()` (scheduling, tier loads and copies included):

- "device": every prompt's blocks sit cached on the device pool; admission hits them.
- "streamed from host": the same blocks were offloaded to the host tier
  (`TierConnector.offload_cached`); admission promotes them back into device blocks
  (kvlab's tier stack when a prefix hit lands in host memory). Requests arrive one after
  another while the others decode, so the decode steps in which one arrives carry its
  loads and the others do not. In every case an arrival step also runs the arriving
  prompt's last tokens (chunked prefill beside the decodes): compare arrival steps with
  arrival steps.
- "held in host": `HostResident`, an experiment, not an engine mode: every running
  sequence's K/V lives in host memory between steps. Before each step every one of its
  blocks is copied host -> device; after it, the blocks the step wrote are copied back,
  and the device copies are overwritten with NaN (untimed), so a step can only produce the
  right token if the copy in happened. A request's prefix is found on the device at
  admission, as in "device"; from its first step on, its K/V is held in host memory.

On a CPU machine "device" and "host" are the same RAM: the copies are memory copies, not a
PCIe link; `project_copy` (kvlab.experiments.tiers) turns their bytes into seconds for a
link bandwidth you give, a what-if and never a measurement.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import kvlab
from kvlab.cache.codecs import StoredKV
from kvlab.cache.tiers import TierConfig
from kvlab.config import EngineConfig, SamplingParams
from kvlab.experiments.tiers import project_copy

CASES = ("device", "streamed from host", "held in host")


@dataclass
class DecodeSetup:
    """The run `decode_itl` makes (one engine, every case).

    Attributes:
        new_tokens: greedy tokens per request (ignore_eos: every case runs the same steps).
        stagger: steps between two requests' arrivals (the later ones arrive mid-decode).
        block_size: tokens per KV block.
        pool_tokens: the device pool, large enough that nothing is evicted.
    """

    new_tokens: int = 8
    stagger: int = 2
    block_size: int = 16
    pool_tokens: int = 4096

    def __post_init__(self) -> None:
        for name in ("new_tokens", "stagger", "block_size", "pool_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"DecodeSetup.{name}={value!r} must be a positive int")


class HostResident:
    """K/V held in host memory, copied into the device blocks for every step.

    `blocks`: device block id -> its stored codes in host memory (`KVPool.read`). `load`
    copies every block of the running sequences in; `save` copies out what a step wrote;
    `evict` overwrites the device copies with NaN (`KVPool.poison`)."""

    def __init__(self, cache):
        self.cache, self.pool = cache, cache.pool
        self.blocks: dict[int, StoredKV] = {}
        self.saved_tokens: dict[int, int] = {}  # request id -> tokens already in host memory

    def load(self, running) -> int:
        """Host -> device: every block of every running sequence. Returns bytes copied."""
        moved = 0
        for block in {b for seq in running for b in self.cache.block_table(seq)}:
            stored = self.blocks[block]
            self.pool.restore(self.cache.block_slots([block]), stored)
            moved += stored.nbytes
        return moved

    def save(self, running) -> int:
        """Device -> host: the blocks each running sequence's step wrote. Returns bytes."""
        moved, bs = 0, self.cache.block_size
        for seq in running:
            table = self.cache.block_table(seq)
            first = self.saved_tokens.get(seq.request_id, 0) // bs
            for block in table[first : -(-seq.num_computed // bs)]:
                self.blocks[block] = self.pool.read(self.cache.block_slots([block]))
                moved += self.blocks[block].nbytes
            self.saved_tokens[seq.request_id] = seq.num_computed
        return moved

    def evict(self, running) -> None:
        """The device no longer holds the running sequences' K/V: NaN in their slots."""
        for seq in running:
            self.pool.poison(self.cache.block_slots(self.cache.block_table(seq)))


def _drive(engine, prompts: list[list[int]], setup: DecodeSetup, case: str) -> tuple[list, list]:
    """Run `prompts` (request i arrives at step i * stagger), one row per step; returns
    (rows, each prompt's output token ids)."""
    params = SamplingParams(max_new_tokens=setup.new_tokens, ignore_eos=True)
    connector, scheduler = engine.cache.connector, engine.scheduler
    host = HostResident(engine.cache) if case == "held in host" else None
    index_of, outputs, rows, step = {}, [None] * len(prompts), [], 0
    while len(index_of) < len(prompts) or engine.has_unfinished():
        arrives = len(index_of) < len(prompts) and step % setup.stagger == 0
        if arrives:
            index_of[engine.add_request(prompts[len(index_of)], params)] = len(index_of)
        decoding = sum(1 for seq in scheduler.running if seq.num_pending == 1)
        loads_before = sum(connector.transfers.onloads.values())
        copied, copy_s = 0, 0.0
        start = time.perf_counter()
        if host is not None:
            copied += host.load(scheduler.running)
            copy_s += time.perf_counter() - start
        finished = engine.step()
        if host is not None:
            saving = time.perf_counter()
            copied += host.save(scheduler.running)
            copy_s += time.perf_counter() - saving
        itl_s = time.perf_counter() - start
        if host is not None:
            host.evict(scheduler.running)  # untimed: the check that the copy in is used
        for out in finished:
            outputs[index_of[out.request_id]] = list(out.token_ids)
        step += 1
        rows.append({
            "case": case,
            "step": step,
            "decode_rows": decoding,
            "arrives": arrives,
            "itl_s": itl_s,
            "loaded_blocks": sum(connector.transfers.onloads.values()) - loads_before,
            "copied_bytes": copied,
            "copy_s": copy_s,
        })  # fmt: skip
    return rows, outputs


def _stats(values: list[float]) -> dict:
    """Median and p90 (inclusive quantiles) of a list of seconds, in ms, and its count."""
    if not values:
        return {"steps": 0, "median_ms": float("nan"), "p90_ms": float("nan")}
    return {"steps": len(values), "median_ms": statistics.median(values) * 1e3,
            "p90_ms": _p90(values) * 1e3}  # fmt: skip


def _p90(values: list[float]) -> float:
    """The 90th percentile (inclusive quantiles, between samples); one value is its own."""
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=10, method="inclusive")[-1]


def decode_itl(model, prompts: list, setup: DecodeSetup | None = None) -> dict:
    """ITL per decode step for `prompts` in every case of CASES (see the module doc).

    Returns {"rows": one dict per step and case (decode_rows > 0: an ITL sample),
    "tokens": case -> each prompt's greedy token ids, "identical": whether every case gave
    the same tokens, "summary": label -> {steps, median_ms, p90_ms} (per case; also the
    decode steps in which a request arrives, device and streamed, and the streamed case's
    other steps), "loaded_blocks": blocks the streamed case loaded back, "block_bytes",
    "bytes_per_step": the held case's median (low) bytes copied per decode step,
    "copy_ms_per_step": its median measured copy time per decode step,
    "projection_s": those bytes over 25 and 100 GB/s (WHAT-IF, not measured)}."""
    setup = setup or DecodeSetup()
    tiers = TierConfig(tiers=("host",), host_blocks=2 * setup.pool_tokens // setup.block_size)
    config = EngineConfig(cache="paged", prefix_caching="hash", block_size=setup.block_size,
                          kv_budget_tokens=setup.pool_tokens, chunked_prefill=True,
                          schedule_order="decode-first", tiers=tiers)  # fmt: skip
    engine = kvlab.Engine(model, config)
    ids = [engine.encode(p) if isinstance(p, str) else list(p) for p in prompts]
    engine.generate(ids, SamplingParams(max_new_tokens=2))  # prompts' blocks cached; warm-up
    connector = engine.cache.connector
    rows, tokens = [], {}
    for case in CASES:
        if case == "streamed from host":
            connector.offload_cached()  # every cached block down to the host tier
        case_rows, tokens[case] = _drive(engine, ids, setup, case)
        rows += case_rows
    engine.cache.check_integrity()
    connector.stack.close()

    def itl(case: str, arrives: bool | None = None) -> list[float]:
        return [r["itl_s"] for r in rows if r["case"] == case and r["decode_rows"]
                and (arrives is None or r["arrives"] == arrives)]  # fmt: skip

    summary = {case: _stats(itl(case)) for case in CASES}
    # A request arrives mid-decode: its prompt's last tokens run beside the decodes in
    # every case; streamed, its blocks are also loaded back from host in that step.
    summary["device: arrival steps"] = _stats(itl("device", True))
    summary["streamed: arrival steps (loads)"] = _stats(itl("streamed from host", True))
    summary["streamed: other steps"] = _stats(itl("streamed from host", False))
    held = [r for r in rows if r["case"] == "held in host" and r["decode_rows"]]
    per_step = statistics.median_low(r["copied_bytes"] for r in held)  # a step that happened
    return {
        "prompt_tokens": [len(p) for p in ids],
        "setup": setup,
        "rows": rows,
        "tokens": tokens,
        "identical": all(tokens[c] == tokens["device"] for c in CASES),
        "summary": summary,
        "loaded_blocks": sum(r["loaded_blocks"] for r in rows if r["case"] == CASES[1]),
        "block_bytes": setup.block_size * engine.cache.pool.bytes_per_token,
        "bytes_per_step": per_step,
        "copy_ms_per_step": statistics.median(r["copy_s"] for r in held) * 1e3,
        "projection_s": {gb_s: project_copy(per_step, gb_s) for gb_s in (25, 100)},
    }


def itl_table(result: dict):
    """decode_itl's summary as a table: one row per case, ITL median and p90 in ms."""
    import pandas as pd

    frame = pd.DataFrame(result["summary"]).T
    frame["steps"] = frame["steps"].astype(int)
    return frame.round(1)
