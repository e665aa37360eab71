"""TierConnector: the KV connector (kvlab.cache.connector) over a TierStack, for the paged
cache with the hash prefix index. It demotes a block the device evicts (`on_evict`), saves a
released request's blocks under write-through (`request_finished`), promotes a prompt's
tier-held blocks back at admission (`promote`) or while it waits (`prefetch`), and accounts
swapped-out requests in the host tier."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvlab.cache.base import KVCache
from kvlab.cache.codecs import StoredKV
from kvlab.cache.connector import ConnectorMeta, KVConnector
from kvlab.cache.tiers.config import TierConfig
from kvlab.cache.tiers.stack import TierStack
from kvlab.integrity import require
from kvlab.sequence import Note, Sequence


@dataclass
class TransferStats:
    """Measured copies between the device pool and the first tier below it."""

    offloads: int = 0  # blocks read off the device (KVPool.read)
    offload_s: float = 0.0
    onloads: dict[str, int] = field(default_factory=dict)  # tier -> blocks loaded onto device
    onload_s: dict[str, float] = field(default_factory=dict)  # tier -> seconds (fetch + restore)
    bytes_offloaded: int = 0
    bytes_onloaded: int = 0
    prefetched: int = 0  # blocks loaded up while their request waited


def tier_connector(config: TierConfig):
    """What PagedCache calls to make its connector: a TierConnector over the stack
    `config` (a TierConfig) describes."""
    return lambda cache: TierConnector(cache, TierStack.from_config(config))


class TierConnector(KVConnector):
    """A KV connector over a `TierStack`, for the paged cache with the hash prefix index."""

    def __init__(self, cache: KVCache, stack: TierStack):
        self.cache, self.stack = cache, stack
        self.salts: dict[bytes, str | None] = {}  # key -> salt of device-indexed blocks
        self.transfers = TransferStats()
        self._loads: list[tuple[int, StoredKV, str]] = []  # scheduler side, not yet built
        self._saves: list[tuple[int, bytes, str | None, bool]] = []
        self._bound = ConnectorMeta()
        self._saved: dict[int, list[StoredKV]] = {}  # bound save -> its layers read so far
        self._prefetched: set[int] = set()  # request ids already prefetched

    @property
    def index(self):
        return self.cache.index

    def _keys(self, seq: Sequence) -> list[bytes]:
        """Chained keys of the prompt's full blocks that may be reused (its last token
        always runs)."""
        bs = self.cache.block_size
        usable = (len(seq.prompt_ids) - 1) // bs * bs
        return self.index.keys(seq.prompt_ids[:usable], seq.salt)

    # --- scheduler side ---------------------------------------------------------------
    def get_num_new_matched_tokens(self, seq, num_computed_tokens):
        keys, bs = self._keys(seq), self.cache.block_size
        found = 0
        for key in keys[num_computed_tokens // bs :]:
            if key not in self.stack:
                break
            found += 1
        return found * bs, False

    def update_state_after_alloc(self, seq, blocks, num_external_tokens):
        require(len(blocks) * self.cache.block_size == num_external_tokens, "loads != blocks")

    def build_connector_meta(self) -> ConnectorMeta:
        meta = ConnectorMeta(self._loads, self._saves)
        self._loads, self._saves = [], []
        return meta

    def request_finished(self, seq, block_ids):
        """Record the salt of every block `seq` indexed; write-through saves them too."""
        tokens = seq.token_ids[: seq.num_computed]
        for key, block in zip(self.index.keys(tokens, seq.salt), block_ids):
            if self.index.key_of.get(block) != key:
                continue  # another block holds this prefix
            self.salts[key] = seq.salt
            if self.stack.write.on_release and any(key not in t for t in self.stack.tiers):
                self._saves.append((block, key, seq.salt, True))
        if self._saves:
            self.run_worker(self.cache.pool.spec.num_layers)
        return False, None

    def on_evict(self, block: int) -> None:
        """The device evicts a cached block: write-back copies it down (write-through
        only if no tier holds it any more)."""
        key = self.index.key_of.get(block)
        if key is None or key not in self.salts:
            return  # never released by a request: its salt is unknown, so it is not saved
        salt = self.salts.pop(key)
        if key not in self.stack.tiers[0]:
            self._saves.append((block, key, salt, False))
            self.run_worker(self.cache.pool.spec.num_layers)

    def promote(self, seq: Sequence, free_only: bool = False) -> int:
        """Load into the device the prompt blocks that tiers hold, as cached blocks the
        prefix index finds (admission then hits them). `free_only`: take free blocks only,
        never evicting (prefetch). Returns the blocks loaded."""
        keys, cache = self._keys(seq), self.cache
        allocator = cache.allocator
        if not self._worth_walking(keys):
            return 0
        chain, loaded = [], []  # device blocks of keys[0:len(chain)], held while loading
        for key in keys:
            block = self.index.block_of.get(key)
            if block is not None:
                allocator.incref(block)
            else:
                room = allocator.num_free if free_only else allocator.num_available
                if not room or key not in self.stack:
                    break
                stored, tier = self.stack.get(key, seq.salt)
                if stored is None:  # corrupt or another salt: recompute
                    break
                block = allocator.allocate()  # may evict (and so demote) another block
                self._loads.append((block, stored, tier))
                loaded.append(block)
                self.salts[key] = seq.salt
            chain.append(block)
        if loaded:
            bs = cache.block_size
            self.update_state_after_alloc(seq, loaded, len(loaded) * bs)
            self.run_worker(self.cache.pool.spec.num_layers)
            self.index.insert(seq.prompt_ids[: len(chain) * bs], chain, seq.salt)
            text = f"tiers: {len(loaded)} block(s) ({len(loaded) * bs} tokens) loaded back"
            seq.notes.append(Note("tiers", "promoted", text + " onto the device"))
        for block in chain:
            allocator.decref(block, keep_cached=cache.sharing.indexed(block))
        return len(loaded)

    def _worth_walking(self, keys: list[bytes]) -> bool:
        """Some key of the reusable chain lies in a tier before the chain breaks."""
        for key in keys:
            if key in self.index.block_of:
                continue
            return key in self.stack
        return False

    def prefetch(self, waiting: list[Sequence], now: float) -> None:
        """prefetch-on-queue: for arrived waiting requests, disk -> host, then host ->
        free device blocks (each request once)."""
        live = {s.request_id for s in waiting}
        self._prefetched &= live
        for seq in waiting:
            if seq.arrival_s > now or seq.request_id in self._prefetched or seq.num_computed:
                continue
            self._prefetched.add(seq.request_id)
            if len(self.stack.tiers) > 1:
                for key in self._keys(seq):
                    if key in self.index.block_of:
                        continue
                    if key not in self.stack or key in self.stack.tiers[0]:
                        continue
                    stored, _ = self.stack.get(key, seq.salt)
                    if stored is None:
                        break
                    self.stack.save(key, seq.salt, stored)
            self.transfers.prefetched += self.promote(seq, free_only=True)

    # --- worker side ------------------------------------------------------------------
    def bind_connector_metadata(self, meta):
        self._bound = meta
        self._saved = {i: [] for i in range(len(meta.saves))}

    def start_load_kv(self):
        """Load whole blocks where the codec's state spans layers (kivi2); else wait per layer.

        Fetching from the tiers happened at `promote`."""
        if not self.cache.pool.layerwise:
            for load in self._bound.loads:
                self._timed_load(load, None)
            self._bound.loads = []

    def wait_for_layer_load(self, layer):
        """Write layer `layer` of every bound load into its device block."""
        for load in self._bound.loads:
            self._timed_load(load, layer)
        if layer == self.cache.pool.spec.num_layers - 1:
            self._bound.loads = []

    def _timed_load(self, load: tuple[int, StoredKV, str], layer: int | None) -> None:
        block, stored, tier = load
        start, pool, slots = time.perf_counter(), self.cache.pool, self.cache.block_slots([block])
        if layer is None:
            pool.restore(slots, stored)
        else:
            pool.restore_layer(layer, slots, stored)
        t, whole = self.transfers, layer in (None, 0)  # a block counts once, at its first layer
        t.onloads[tier] = t.onloads.get(tier, 0) + int(whole)
        t.onload_s[tier] = t.onload_s.get(tier, 0.0) + time.perf_counter() - start
        t.bytes_onloaded += stored.nbytes if whole else 0

    def save_kv_layer(self, layer):
        """Read layer `layer` of every bound save off the device (layer-wise codecs)."""
        if not self.cache.pool.layerwise:
            return
        for i, (block, *_) in enumerate(self._bound.saves):
            start = time.perf_counter()
            self._saved[i].append(
                self.cache.pool.read_layer(layer, self.cache.block_slots([block]))
            )
            self.transfers.offload_s += time.perf_counter() - start

    def wait_for_save(self):
        """Put each bound save's layers together (or read it whole) and store it in the tiers."""
        for i, (block, key, salt, everywhere) in enumerate(self._bound.saves):
            start = time.perf_counter()
            if self._saved[i]:
                stored = StoredKV.cat(self._saved[i])
            else:
                stored = self.cache.pool.read(self.cache.block_slots([block]))
            self.transfers.offloads += 1
            self.transfers.offload_s += time.perf_counter() - start
            self.transfers.bytes_offloaded += stored.nbytes
            if everywhere:
                self.stack.save_everywhere(key, salt, stored)
            else:
                self.stack.save(key, salt, stored)
        self._bound.saves, self._saved = [], {}

    # --- swap preemption through the host tier ---------------------------------------
    def _host(self):
        first = self.stack.tiers[0]
        return first if first.name == "host" else None

    def swap_out(self, seq: Sequence, saved: StoredKV) -> None:
        """A swapped-out request's blocks take room in the host tier until it returns."""
        host = self._host()
        if host is not None:
            blocks = -(-seq.num_computed // self.cache.block_size)
            for entry in host.hold(seq.request_id, blocks):
                if len(self.stack.tiers) > 1:
                    self.stack.save(*entry, level=1)

    def swap_done(self, seq: Sequence) -> None:
        """The request swapped back in, or ended while swapped out: free its room."""
        host = self._host()
        if host is not None:
            host.release(seq.request_id)

    # --- whole-cache moves (experiments, sessions) -----------------------------------
    def offload_cached(self) -> int:
        """Evict every cached device block now, through the write policy (experiments:
        to measure a host hit). Returns the blocks moved off the device."""
        moved = 0
        for block in list(self.cache.allocator.cached):
            self.on_evict(block)
            self.cache.sharing.forget(block)
            self.cache.allocator.uncache(block)
            moved += 1
        return moved

    def discard(self, key: bytes) -> list[str]:
        """Drop a block key from every tier below the device; the tiers that held it."""
        self.salts.pop(key, None)
        return self.stack.discard(key)

    def check_integrity(self) -> None:
        self.stack.check_integrity()
        require(not self._loads and not self._saves, "connector work left unbuilt")
        for block in self.cache.allocator.cached:
            require(block in self.index.key_of, f"cached block {block} has no key")
