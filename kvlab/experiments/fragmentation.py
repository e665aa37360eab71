"""Fragmentation, named and measured: KV memory that is held or free but holds no token.

The PagedAttention paper (Kwon et al., SOSP 2023, arXiv:2309.06180, §3.1) names three
sources of waste when each request gets one contiguous chunk: *reserved* slots for future
tokens, *internal fragmentation* (over-provisioning for the maximum length) and *external
fragmentation* (from the allocator). kvlab measures three kinds (notebook 02):

- reservation (naive cache): the slots a sequence's max_model_len region holds beyond the
  tokens it has written; the paper's reserved slots plus its internal fragmentation;
- internal fragmentation (paged cache): the unwritten tail of a sequence's last block, at
  most block_size - 1 slots per sequence;
- external fragmentation: free memory a request cannot use because a contiguous allocator
  needs one hole as large as the request and the free memory lies in smaller holes.

`trace_waste` serves a workload on a real engine and reads, after every step, each running
sequence's written tokens and held slots (the first two kinds). `ContiguousAllocator` is a
teaching first-fit allocator over one address range; `replay_stream` sends one stream of
arriving and finishing requests through it and through kvlab's `BlockAllocator` side by
side, and keeps the first moment the contiguous one refuses a request that the free total
could hold.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import pandas as pd

from kvlab.build import Engine
from kvlab.cache.allocator import BlockAllocator
from kvlab.cache.base import KVCache
from kvlab.engine.outputs import RequestOutput
from kvlab.integrity import require
from kvlab.units import ceil_div
from kvlab.workloads import Request

INTERNAL, RESERVATION = "internal fragmentation", "reservation"
TRACE_COLUMNS = ["step", "request", "written", "held", "unwritten", "kind"]


# --- reservation and internal fragmentation, read from a live cache ------------------------
def sequence_waste(cache: KVCache) -> list[dict]:
    """One row per running sequence of `cache`: request, written (tokens whose K/V are
    stored), held (slots its block table covers), unwritten (held - written) and kind.

    A cache whose block holds a whole max_model_len sequence (the naive cache) reserves:
    its unwritten slots are reservation. Otherwise they are the tail of the last block:
    internal fragmentation.
    """
    kind = RESERVATION if cache.block_size >= cache.max_model_len else INTERNAL
    rows = []
    for request_id, seq in sorted(cache.sequences.items()):
        held, written = len(cache.block_table(seq)) * cache.block_size, seq.num_computed
        rows.append(dict(request=request_id, written=written, held=held,
                         unwritten=held - written, kind=kind))  # fmt: skip
    return rows


def trace_waste(
    engine: Engine, requests: Seq[Request], *, ignore_eos: bool = False
) -> tuple[list[RequestOutput], pd.DataFrame]:
    """Serve `requests` as `engine.run` does, reading `sequence_waste` after every step.

    Returns the outputs in request order and one row per (step, running sequence) with
    TRACE_COLUMNS; `step` numbers the engine's telemetry rows (`engine.stats()["step"]`).
    """
    seqs = engine.workload_sequences(requests, ignore_eos=ignore_eos)
    for seq in seqs:
        engine.enqueue(seq)
    ids = [seq.request_id for seq in seqs]
    outputs: dict[int, RequestOutput] = {}
    rows: list[dict] = []
    while any(i not in outputs for i in ids):
        before = len(engine.telemetry.records)
        outputs.update((out.request_id, out) for out in engine.step())
        step = len(engine.telemetry.records)
        if step > before:  # a step that ran (an idle wait records nothing)
            rows += [{"step": step, **row} for row in sequence_waste(engine.cache)]
    return [outputs[i] for i in ids], pd.DataFrame(rows, columns=TRACE_COLUMNS)


def waste_by_request(trace: pd.DataFrame) -> pd.DataFrame:
    """Per request of a `trace_waste` frame: its kind of waste, tokens written after its
    first step and after the last step it was still running at, and slots held unwritten
    after its first step and at most over its steps (internal fragmentation: at most
    block_size - 1)."""
    g = trace.sort_values("step").groupby("request")
    return pd.DataFrame(
        {
            "kind": g["kind"].first(),
            "written first": g["written"].first(),
            "written last": g["written"].last(),
            "unwritten first": g["unwritten"].first(),
            "unwritten max": g["unwritten"].max(),
        }
    )


# --- external fragmentation: a contiguous allocator beside the paged one -----------------
class ContiguousAllocator:
    """First fit over one address range of `capacity` units: a request gets one region of
    the size it asks for, at the start of the lowest-addressed hole that is large enough,
    or nothing (a refusal), however much is free in total."""

    def __init__(self, capacity: int):
        if capacity <= 0:
            raise ValueError(f"capacity={capacity} must be > 0")
        self.capacity = capacity
        self.regions: dict[int, tuple[int, int]] = {}  # owner -> (start, size)

    def holes(self) -> list[tuple[int, int]]:
        """The free gaps between regions, (start, size) in address order."""
        out, at = [], 0
        for start, size in sorted(self.regions.values()):
            if start > at:
                out.append((at, start - at))
            at = start + size
        if at < self.capacity:
            out.append((at, self.capacity - at))
        return out

    @property
    def free_total(self) -> int:
        return self.capacity - sum(size for _, size in self.regions.values())

    @property
    def largest_hole(self) -> int:
        return max((size for _, size in self.holes()), default=0)

    def allocate(self, owner: int, size: int) -> int | None:
        """Give `owner` the first hole of at least `size` units; returns the region's
        start, or None when no single hole is that large (the request must wait)."""
        if size <= 0:
            raise ValueError(f"size={size} must be > 0")
        if owner in self.regions:
            raise ValueError(f"owner {owner} holds a region already")
        for start, hole in self.holes():
            if hole >= size:
                self.regions[owner] = (start, size)
                return start
        return None

    def free(self, owner: int) -> None:
        """Give `owner`'s region back: it becomes (part of) a hole."""
        if owner not in self.regions:
            raise ValueError(f"owner {owner} holds no region (double free?)")
        del self.regions[owner]

    def check_integrity(self) -> None:
        at = 0
        for start, size in sorted(self.regions.values()):
            require(size > 0 and start >= at, f"region at {start} overlaps the one before it")
            at = start + size
        require(at <= self.capacity, f"a region ends at {at}, past capacity {self.capacity}")
        holes = sum(size for _, size in self.holes())
        require(holes == self.free_total, f"holes {holes} != free total {self.free_total}")


@dataclass(frozen=True)
class StreamRequest:
    """One request of a replayed stream, in blocks and steps."""

    request: int
    arrival: int  # the step it arrives at
    need: int  # blocks it holds from admission to finish (prompt + answer, rounded up)
    lifetime: int  # steps it runs: one token per step

    def __post_init__(self) -> None:
        if self.need < 1 or self.lifetime < 1 or self.arrival < 0:
            raise ValueError(f"{self}: need and lifetime must be >= 1, arrival >= 0")


def stream_from(
    requests: Seq[Request], prompt_tokens: Seq[int], block_size: int
) -> list[StreamRequest]:
    """Requests as a stream: each needs ceil((prompt + max_new_tokens) / block_size) blocks
    for max_new_tokens steps, arriving at step floor(arrival_s) (its seconds read as steps)."""
    return [
        StreamRequest(
            request=i,
            arrival=int(r.arrival_s),
            need=ceil_div(p + r.max_new_tokens, block_size),
            lifetime=r.max_new_tokens,
        )
        for i, (r, p) in enumerate(zip(requests, prompt_tokens, strict=True))
    ]


def paged_admit(layout: ContiguousAllocator, owner: int, need: int) -> tuple[list[int], list[int]]:
    """The same address range under kvlab's BlockAllocator: the blocks `layout`'s regions
    cover are in use, its holes' blocks free (listed in address order), and `owner` takes
    `need` of them, wherever they lie. Returns its blocks and the owner of every block
    (-1 free). Raises OutOfBlocks only when fewer than `need` blocks are free in total."""
    allocator = BlockAllocator(layout.capacity)
    owners = [-1] * layout.capacity
    for region_owner, (start, size) in layout.regions.items():
        owners[start : start + size] = [region_owner] * size
    for _ in range(layout.capacity):  # take every block (in address order) ...
        allocator.allocate()
    for block, region_owner in enumerate(owners):  # ... and give the holes' blocks back
        if region_owner < 0:
            allocator.decref(block)
    blocks = [allocator.allocate() for _ in range(need)]
    allocator.check_integrity()
    for block in blocks:
        owners[block] = owner
    return blocks, owners


@dataclass(frozen=True)
class Refusal:
    """The first moment the contiguous allocator refused a request that the free total
    could hold, and the paged allocator admitting it into the same free blocks."""

    step: int
    request: int
    need: int  # blocks
    free_total: int  # blocks free in the address range
    largest_hole: int  # blocks
    holes: list[tuple[int, int]]  # (start, size), address order
    regions: dict[int, tuple[int, int]]  # the contiguous layout: owner -> (start, size)
    paged_blocks: list[int]  # `paged_admit`: the blocks the BlockAllocator gave the request
    paged_owners: list[int]  # owner of every block after that, -1 free

    def paged_runs(self) -> list[tuple[int, int]]:
        """The request's paged blocks as runs of neighbours: (first, last), address order."""
        runs: list[list[int]] = []
        for block in sorted(self.paged_blocks):
            if runs and runs[-1][1] == block - 1:
                runs[-1][1] = block
            else:
                runs.append([block, block])
        return [(a, b) for a, b in runs]


@dataclass
class StreamReplay:
    """What `replay_stream` found."""

    num_blocks: int
    # per step and allocator: free, largest_hole (paged: all free blocks), running, waiting
    timeline: pd.DataFrame
    refusals: pd.DataFrame  # every contiguous refusal: step, request, need, free, hole
    first: Refusal | None  # the first refusal with free >= need (external fragmentation)
    finished: dict[str, int] = field(default_factory=dict)  # allocator -> step all were done

    def summary(self) -> pd.DataFrame:
        """Per allocator: steps to serve the stream, steps in which it refused its queue's
        head while enough was free in total (external fragmentation), and request-steps
        spent waiting."""
        t, external = self.timeline, self.refusals["free"] >= self.refusals["need"]
        rows = {}
        for name, lane in t.groupby("allocator", sort=False):
            refused = int(external.sum()) if name == "contiguous" else 0
            rows[name] = {
                "steps": self.finished[name],
                "steps refused with enough free": refused,
                "request-steps waiting": int(lane["waiting"].sum()),
            }
        return pd.DataFrame.from_dict(rows, orient="index")


class _Contiguous:
    def __init__(self, num_blocks: int):
        self.allocator = ContiguousAllocator(num_blocks)

    def admit(self, r: StreamRequest) -> bool:
        return self.allocator.allocate(r.request, r.need) is not None

    def release(self, request: int) -> None:
        self.allocator.free(request)

    def free(self) -> int:
        return self.allocator.free_total

    def largest(self) -> int:
        return self.allocator.largest_hole


class _Paged:
    """kvlab's BlockAllocator, a request taking its blocks from the free list one by one."""

    def __init__(self, num_blocks: int):
        self.allocator = BlockAllocator(num_blocks)
        self.tables: dict[int, list[int]] = {}

    def admit(self, r: StreamRequest) -> bool:
        if r.need > self.allocator.num_free:
            return False
        self.tables[r.request] = [self.allocator.allocate() for _ in range(r.need)]
        return True

    def release(self, request: int) -> None:
        for block in reversed(self.tables.pop(request)):  # tail first, as PagedCache does
            self.allocator.decref(block)

    def free(self) -> int:
        return self.allocator.num_free

    def largest(self) -> int:  # any free block will do: the largest usable "hole" is all of it
        return self.allocator.num_free


def replay_stream(stream: Seq[StreamRequest], num_blocks: int) -> StreamReplay:
    """Serve `stream` through a ContiguousAllocator and a BlockAllocator of `num_blocks`
    blocks each, step by step: finished requests give their blocks back, arrivals join
    a first-come-first-served queue, and the queue's head is admitted while it fits (a
    head that does not fit waits, and so does everyone behind it).

    Both take a request's whole need when they admit it and give it back when it finishes,
    so until the contiguous allocator first refuses a request while the free total could
    hold it, both hold the same requests: that refusal is external fragmentation alone.
    `first` records it, with `paged_admit` placing the request into the same free blocks.
    """
    too_big = [r for r in stream if r.need > num_blocks]
    if too_big:
        raise ValueError(f"request {too_big[0].request} needs {too_big[0].need} blocks > "
                         f"num_blocks={num_blocks}: it could never be admitted")  # fmt: skip
    lanes = {"contiguous": _Contiguous(num_blocks), "paged": _Paged(num_blocks)}
    queues: dict[str, deque[StreamRequest]] = {name: deque() for name in lanes}
    ends: dict[str, dict[int, int]] = {name: {} for name in lanes}  # request -> finish step
    done = {name: 0 for name in lanes}
    timeline, refusals, first, finished = [], [], None, {}
    step = 0
    while len(finished) < len(lanes):
        refused_now = None
        for name, lane in lanes.items():
            if name in finished:
                continue
            for request in [r for r, end in ends[name].items() if end == step]:
                lane.release(request)
                del ends[name][request]
                done[name] += 1
            queues[name].extend(r for r in stream if r.arrival == step)
            while queues[name]:
                head = queues[name][0]
                if not lane.admit(head):
                    if name == "contiguous":
                        row = (step, head.request, head.need, lane.free(), lane.largest())
                        refusals.append(row)
                        if first is None and lane.free() >= head.need:
                            refused_now = head
                    break
                queues[name].popleft()
                ends[name][head.request] = step + head.lifetime
            timeline.append((step, name, lane.free(), lane.largest(), len(ends[name]),
                             len(queues[name])))  # fmt: skip
            if done[name] == len(stream):
                finished[name] = step
        if refused_now is not None:
            contiguous = lanes["contiguous"].allocator
            blocks, owners = paged_admit(contiguous, refused_now.request, refused_now.need)
            first = Refusal(
                step=step,
                request=refused_now.request,
                need=refused_now.need,
                free_total=contiguous.free_total,
                largest_hole=contiguous.largest_hole,
                holes=contiguous.holes(),
                regions=dict(contiguous.regions),
                paged_blocks=blocks,
                paged_owners=owners,
            )
        step += 1
    columns = ["step", "allocator", "free", "largest_hole", "running", "waiting"]
    return StreamReplay(
        num_blocks=num_blocks,
        timeline=pd.DataFrame(timeline, columns=columns),
        refusals=pd.DataFrame(refusals, columns=["step", "request", "need", "free", "hole"]),
        first=first,
        finished=finished,
    )
