"""Measurements of the KV hierarchy (kvlab.cache.tiers) on a multi-turn chat trace.

- `compare_tiering`: the same sessions through device-only prefix caching and through
  tier configurations: prompt tokens recomputed, hits per tier, bytes moved, outputs.
- `ttft_by_tier`: time to first token of one turn whose history sits on the device, in the
  host tier, in the disk tier, or nowhere (recomputed).
- `copy_times`: seconds per block to copy device -> host, host -> device, and to write and
  read a disk-tier file, measured here; `project_copy` turns bytes into seconds for a link
  bandwidth you give (a what-if, labelled so, never a measurement).
"""

from __future__ import annotations

import statistics
import time

import kvlab
from kvlab.cache.prefix.hash import HashPrefixIndex
from kvlab.cache.tiers import TierConfig
from kvlab.cache.tiers.disk import DiskTier
from kvlab.config import EngineConfig, SamplingParams
from kvlab.multiturn import ChatSession, Turn, first_turn_ids, next_turn_ids, run_sessions
from kvlab.workloads import Request

BASE = dict(cache="paged", prefix_caching="hash")


def working_set_blocks(turns: list[Turn], block_size: int) -> int:
    """Distinct full blocks (chained keys) over every turn's prompt: what a cache would
    have to hold to recompute nothing but each turn's new tail."""
    keyer = HashPrefixIndex(block_size)
    return len({k for t in turns for k in keyer.keys(list(t.prompt_ids), None)})


def tier_configs(pool_blocks: int) -> dict[str, TierConfig | None]:
    """The configurations `compare_tiering` runs, sized from the device pool: a host tier
    of 4x the pool; host 1x + disk 8x; and the other policies on host 1x + disk 8x."""
    small = dict(tiers=("host", "disk"), host_blocks=pool_blocks, disk_blocks=8 * pool_blocks)
    return {
        "device only": None,
        "host": TierConfig(tiers=("host",), host_blocks=4 * pool_blocks),
        "host+disk": TierConfig(**small),
        "host+disk write-through": TierConfig(**small, write="write-through"),
        "host+disk prefetch": TierConfig(**small, load="prefetch-on-queue"),
    }


def run_trace(model, sessions: list[ChatSession], config: EngineConfig, **kwargs) -> dict:
    """One engine, the whole trace; its turns, counts and the tiers' accounting."""
    engine = kvlab.Engine(model, config)
    started = time.perf_counter()
    turns = run_sessions(engine, sessions, **kwargs)
    wall = time.perf_counter() - started
    engine.cache.check_integrity()
    row = {
        "prompt_tokens": sum(t.prompt_tokens for t in turns),
        "computed_tokens": sum(t.computed_tokens for t in turns),
        "ttft_mean_s": statistics.fmean(t.ttft_s for t in turns),
        "wall_s": wall,
        "evictions": engine.cache.allocator.evictions,
    }
    connector = engine.cache.connector
    if connector is not None:
        moved = connector.transfers
        row.update(
            offloaded_blocks=moved.offloads,
            offload_s_per_block=moved.offload_s / max(moved.offloads, 1),
            onloaded_blocks=dict(moved.onloads),
            bytes_offloaded=moved.bytes_offloaded,
            bytes_onloaded=moved.bytes_onloaded,
            prefetched_blocks=moved.prefetched,
            tiers=connector.stack.stats(),
        )
        connector.stack.close()
    outputs = {(t.session_id, t.turn): t.output_ids for t in turns}
    return {"row": row, "turns": turns, "outputs": outputs}


def compare_tiering(
    model,
    sessions: list[ChatSession],
    pool_tokens: int,
    block_size: int = 16,
    max_new_tokens: int = 16,
    concurrency: int = 2,
    configs: dict[str, TierConfig | None] | None = None,
    max_model_len: int = 2048,
    end_after: bool = False,
    observe: str | None = None,
    every: int = 4,
) -> dict:
    """Every configuration on the same trace; the reduction in recomputed prompt tokens
    against device-only caching, and whether every turn's greedy tokens are identical.
    `end_after`: each session ends after its last turn (end_session frees its blocks).
    `observe`: record `snapshot` frames of that configuration every `every` steps
    (result["frames"], for viz.tiers.hierarchy_figure)."""
    pool_blocks = pool_tokens // block_size
    configs = configs if configs is not None else tier_configs(pool_blocks)
    rows, reference, observed = {}, None, []
    for name, tiers in configs.items():
        config = EngineConfig(**BASE, block_size=block_size, kv_budget_tokens=pool_tokens,
                              max_model_len=max_model_len, tiers=tiers)  # fmt: skip
        frames: list[tuple[str, list[dict]]] = []

        def record(engine, frames=frames, name=name):
            steps = len(engine.telemetry.records)
            if name == observe and steps % every == 0:
                frames.append((f"step {steps}", snapshot(engine)))

        run = run_trace(model, sessions, config, max_new_tokens=max_new_tokens,
                        concurrency=concurrency, end_after=end_after, on_step=record)  # fmt: skip
        if name == observe:
            observed = frames
        if reference is None:
            reference = run
        row = run["row"]
        base = reference["row"]["computed_tokens"]
        row["recompute_reduction"] = 1 - row["computed_tokens"] / base if base else 0.0
        row["identical_outputs"] = run["outputs"] == reference["outputs"]
        rows[name] = row
    working = working_set_blocks(reference["turns"], block_size)
    return {
        "sessions": len(sessions),
        "turns": len(reference["turns"]),
        "pool_blocks": pool_blocks,
        "working_set_blocks": working,
        "working_set_over_pool": working / pool_blocks,
        "configs": rows,
        "frames": observed,
    }


def ttft_by_tier(model, session: ChatSession, questions: list[str], block_size: int = 16) -> dict:
    """Median TTFT of a follow-up turn (the opening turn's prompt + a new question) when
    the opening's blocks sit on the device, in the host tier, on disk, or nowhere.

    Each measured request runs alone (max_new_tokens=1). The disk file may be in the OS
    page cache (nothing drops it): a disk hit here is a read through the file system."""
    tiers = TierConfig(tiers=("host", "disk"), host_blocks=4096, disk_blocks=4096)
    config = EngineConfig(**BASE, block_size=block_size, max_model_len=None,
                          kv_budget_tokens=8192, tiers=tiers)  # fmt: skip
    engine = kvlab.Engine(model, config)
    connector, one = engine.cache.connector, SamplingParams(max_new_tokens=1)
    opening = first_turn_ids(engine.tokenizer, session.messages[0])
    times: dict[str, list[float]] = {"device": [], "host": [], "disk": [], "recompute": []}
    hits: dict[str, list[int]] = {name: [] for name in times}

    def measure(where: str, ids: list[int], salt: str) -> None:
        [out] = engine.run([Request(ids, 1, salt=salt)])
        times[where].append(out.metrics.ttft_s)
        hits[where].append(out.metrics.prefix_hit_tokens)

    for r, question in enumerate(questions):
        # Each measured prompt differs from the others right after the opening (its
        # message begins with the tier's name), so every hit is the opening's blocks.
        def ask(where: str, question: str = question) -> list[int]:
            return next_turn_ids(engine.tokenizer, opening, f"({where}) {question}")

        measure("recompute", ask("recompute"), f"repeat-{r}")  # nothing under this salt
        engine.generate([opening], one)  # the opening's blocks, on the device
        measure("device", ask("device"), None)
        connector.offload_cached()  # every cached block down to the host tier
        measure("host", ask("host"), None)
        connector.offload_cached()
        connector.stack.spill(0)  # and from host to disk
        measure("disk", ask("disk"), None)
        connector.offload_cached()
        for tier in connector.stack.tiers:  # the next repeat starts from empty tiers
            for key in tier.keys():
                tier.discard(key)
    connector.stack.close()
    return {
        "prompt_tokens": len(opening),
        "repeats": len(questions),
        "ttft_median_s": {w: statistics.median(ts) for w, ts in times.items()},
        "hit_tokens": {w: statistics.median(h) for w, h in hits.items()},
    }


def copy_times(model, kv_codec: str | None = None, block_size: int = 16, repeats: int = 20) -> dict:
    """Seconds per block, measured on this machine: device -> host (KVPool.read), host ->
    device (KVPool.restore), disk-tier file write and read (checksum included)."""
    config = EngineConfig(**BASE, block_size=block_size, kv_budget_tokens=block_size * 64,
                          kv_codec=kv_codec, max_model_len=512)  # fmt: skip
    engine = kvlab.Engine(model, config)
    engine.generate([list(range(1, 2 * block_size + 2))], SamplingParams(max_new_tokens=1))
    cache, pool = engine.cache, engine.cache.pool
    slots = cache.block_slots([0])
    disk = DiskTier(repeats + 1)
    timings: dict[str, list[float]] = {"device_to_host": [], "host_to_device": [],
                                       "disk_write": [], "disk_read": []}  # fmt: skip
    for i in range(repeats):
        start = time.perf_counter()
        stored = pool.read(slots)
        timings["device_to_host"].append(time.perf_counter() - start)
        start = time.perf_counter()
        pool.restore(cache.block_slots([1]), stored)
        timings["host_to_device"].append(time.perf_counter() - start)
        key = i.to_bytes(16, "little")
        start = time.perf_counter()
        disk.put(key, None, stored)
        timings["disk_write"].append(time.perf_counter() - start)
        start = time.perf_counter()
        if disk.get(key, None) is None:
            raise RuntimeError("the disk tier lost a block it just wrote")
        timings["disk_read"].append(time.perf_counter() - start)
    disk.close()
    return {
        "block_tokens": block_size,
        "block_bytes": stored.nbytes,
        "kv_codec": kv_codec,
        "device": str(pool.device),
        "median_s": {k: statistics.median(v) for k, v in timings.items()},
    }


def project_copy(block_bytes: int, link_gb_s: float) -> float:
    """WHAT-IF, not a measurement: seconds to move one block over a link of `link_gb_s`
    GB/s (e.g. ~25 for PCIe 4.0 x16 host <-> GPU), ignoring latency."""
    if link_gb_s <= 0:
        raise ValueError(f"link_gb_s={link_gb_s} must be > 0")
    return block_bytes / (link_gb_s * 1e9)


def snapshot(engine) -> list[dict]:
    """Where every block sits now: one row per block on the device (used or cached), in
    each tier below, with the session whose conversation it holds ("shared" if several,
    "-" if none is recorded)."""
    cache, owners = engine.cache, {}
    keyer = HashPrefixIndex(cache.block_size)
    for sid, record in engine.sessions.records.items():
        for tokens, salt in record.prefixes:
            for key in keyer.keys(list(tokens), salt):
                owners[key] = sid if owners.get(key, sid) == sid else "shared"
    for seq in cache.sequences.values():  # running turns: their published blocks
        if seq.session is not None:
            for key in keyer.keys(seq.token_ids[: seq.num_computed], seq.salt):
                owners[key] = (
                    seq.session if owners.get(key, seq.session) == seq.session else "shared"
                )
    rows = []
    key_of = cache.index.key_of if cache.index is not None else {}
    for block in range(cache.num_blocks):
        refs = cache.allocator.ref_counts[block]
        if refs == 0 and block not in cache.allocator.cached:
            continue
        where = "device (used)" if refs else "device (cached)"
        rows.append({"tier": where, "block": block, "session": owners.get(key_of.get(block), "-")})
    connector = cache.connector
    for tier in connector.stack.tiers if connector is not None else ():
        for i, key in enumerate(tier.keys()):
            rows.append({"tier": tier.name, "block": i, "session": owners.get(key, "-")})
    return rows


def policy_table(trace: dict):
    """compare_tiering's result as a table: one row per configuration."""
    import pandas as pd

    rows = []
    for name, row in trace["configs"].items():
        tiers_ = row.get("tiers", {})
        rows.append({
            "config": name,
            "computed tokens": row["computed_tokens"],
            "reduction": round(row["recompute_reduction"], 3),
            "identical": row["identical_outputs"],
            "blocks offloaded": row.get("offloaded_blocks", 0),
            "host hits": tiers_.get("host", {}).get("loads", 0),
            "disk hits": tiers_.get("disk", {}).get("loads", 0),
            "prefetched": row.get("prefetched_blocks", 0),
        })  # fmt: skip
    return pd.DataFrame(rows).set_index("config")
