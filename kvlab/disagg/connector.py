"""PrefillDecodeConnector: the KV connector (kvlab.cache.connector) that moves a prefilled
request's KV from the prefill engine to the decode engine, with vLLM's P/D roles.

    prefill engine, kv_role="kv_producer"     decode engine, kv_role="kv_consumer"
    request_finished(seq, block_ids)          get_num_new_matched_tokens(seq, 0)
      save_kv_layer(layer)   per layer          (the scheduler swaps it in: blocks allocated)
      wait_for_save() -> transport  --pipe-->  update_state_after_alloc(seq, blocks, n)
                                                start_load_kv()
                                                wait_for_layer_load(layer)   per layer

Layer-wise codecs (`KVPool.layerwise`) move one layer at a time (`read_layer` /
`restore_layer`); kivi2's windows span layers, so it moves whole (`read` in
`wait_for_save`, `restore` in `start_load_kv`). As in TierConnector, kvlab runs the worker
side at once, after the scheduler-side call that needs it (vLLM runs it inside the
forward: layer i's load overlaps layer i-1's attention, layer i's save follows it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvlab.cache.base import KVCache
from kvlab.cache.codecs import StoredKV
from kvlab.cache.connector import ConnectorMeta, KVConnector
from kvlab.disagg.transfer import KVTransfer, checksum
from kvlab.integrity import require
from kvlab.sequence import Sequence

ROLES = ("kv_producer", "kv_consumer")  # vLLM's KVTransferConfig.kv_role values
Transport = Callable[[Sequence, StoredKV, str], None]  # (request, its KV, checksum) -> sent


@dataclass
class LayerStats:
    """Measured moves between the pool and host memory, in this connector's role."""

    requests: int = 0
    bytes: int = 0
    seconds: float = 0.0
    layer_bytes: list[int] = field(default_factory=list)  # per layer (layer-wise codecs)
    layer_s: list[float] = field(default_factory=list)


class PrefillDecodeConnector(KVConnector):
    """The KV connector between a prefill engine (producer) and a decode engine (consumer).

    The producer sends each finished prefill's KV through `transport` (prefill.py's pipe);
    the consumer `receive`s those transfers and loads the intact ones into the blocks its
    cache allocates when the scheduler swaps the request in.
    """

    def __init__(self, role: str, cache: KVCache, transport: Transport | None = None):
        require(role in ROLES, f"kv_role {role!r} is not one of {ROLES}")
        require((role == "kv_producer") == (transport is not None), "a producer needs a transport")
        self.role, self.cache, self.transport = role, cache, transport
        layers = cache.pool.spec.num_layers
        self.stats = LayerStats(layer_bytes=[0] * layers, layer_s=[0.0] * layers)
        self.arrived: dict[int, KVTransfer] = {}  # consumer: request id -> transfer, not loaded
        self._loads: list[tuple[int, torch.Tensor, StoredKV]] = []  # request id, slots, KV
        self._saves: list[tuple[Sequence, torch.Tensor]] = []  # request, its slots (T,)
        self._bound = ConnectorMeta()
        self._parts: dict[int, list[StoredKV]] = {}  # request id -> saved layers so far
        self._layer = {"load": -1, "save": -1}  # the last layer each walk reached

    @property
    def _layerwise(self) -> bool:
        return self.cache.pool.layerwise

    def _slots(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        """Pool slots of positions [0, num_tokens) over `block_ids`, (num_tokens,) int64."""
        return self.cache.block_slots(block_ids)[:num_tokens]

    # --- the transport's end on the consumer ------------------------------------------
    def receive(self, seq: Sequence, transfer: KVTransfer) -> bool:
        """A transfer for `seq` arrived (consumer): keep it until `seq` is admitted if it is
        intact (checksum, and exact bytes for token codecs); drop it if not. Returns which."""
        require(self.role == "kv_consumer", "only the consumer receives")
        pool = self.cache.pool  # grouped codecs (kivi2) also move their windows
        if not transfer.intact(pool.bytes_per_token if pool.codec.alignment == 1 else None):
            return False  # never decoded on bad KV
        self.arrived[seq.request_id] = transfer
        return True

    # --- scheduler side ---------------------------------------------------------------
    def get_num_new_matched_tokens(self, seq, num_computed_tokens):
        """Consumer: the prompt tokens past `num_computed_tokens` that an arrived intact
        transfer supplies (0 if none did: a corrupt or truncated one was dropped)."""
        transfer = self.arrived.get(seq.request_id)
        if transfer is None:
            return 0, False
        return len(transfer.prompt_ids) - num_computed_tokens, False

    def update_state_after_alloc(self, seq, blocks, num_external_tokens):
        """Consumer: the decode cache allocated `blocks` for the transfer: record its load."""
        transfer = self.arrived.pop(seq.request_id)
        require(num_external_tokens == len(transfer.prompt_ids), "load != the prompt's KV")
        slots = self._slots(blocks, num_external_tokens)
        self._loads.append((seq.request_id, slots, transfer.stored))

    def build_connector_meta(self) -> ConnectorMeta:
        """Hand over the recorded loads (consumer) or saves (producer), and forget them."""
        meta = ConnectorMeta(self._loads, self._saves)
        self._loads, self._saves = [], []
        return meta

    def request_finished(self, seq, block_ids):
        """Producer: `seq`'s prefill is done: save its KV and send it, before its blocks
        go (the save ends before this returns). Consumer: forget a transfer never loaded."""
        if self.role == "kv_consumer":
            self.arrived.pop(seq.request_id, None)
            return False, None
        self._saves.append((seq, self._slots(block_ids, seq.num_computed)))
        self.run_worker(self.cache.pool.spec.num_layers)
        return False, None

    def load(self, seq: Sequence) -> None:
        """Consumer, as the scheduler swaps `seq` in (the cache has allocated blocks for
        its prompt): the load is recorded and the worker side runs it."""
        matched, _ = self.get_num_new_matched_tokens(seq, 0)
        require(matched == seq.num_computed, f"request {seq.request_id}: no intact transfer")
        self.update_state_after_alloc(seq, self.cache.block_table(seq), matched)
        self.run_worker(self.cache.pool.spec.num_layers)

    # --- worker side ------------------------------------------------------------------
    def bind_connector_metadata(self, meta):
        self._bound = meta
        self._layer = {"load": -1, "save": -1}

    def start_load_kv(self):
        """Non-layer-wise codecs (kivi2) restore every load whole now; layer-wise ones
        load each layer in `wait_for_layer_load`."""
        if self._layerwise:
            return
        for _, slots, stored in self._bound.loads:
            start = time.perf_counter()
            self.cache.pool.restore(slots, stored)
            self._count(stored.nbytes, time.perf_counter() - start)
        self._bound.loads = []

    def wait_for_layer_load(self, layer):
        """Restore `layer` of every bound load (layer-wise codecs), in layer order."""
        if not self._bound.loads:
            return
        self._step("load", layer)
        for _, slots, stored in self._bound.loads:
            start = time.perf_counter()
            self.cache.pool.restore_layer(layer, slots, stored)
            self._count_layer(layer, stored.layer(layer).nbytes, start)
        if layer == self.cache.pool.spec.num_layers - 1:
            self.stats.requests += len(self._bound.loads)
            self._bound.loads = []

    def save_kv_layer(self, layer):
        """Read `layer` of every bound save off the pool (layer-wise codecs), in layer order."""
        if not self._bound.saves or not self._layerwise:
            return
        self._step("save", layer)
        for seq, slots in self._bound.saves:
            start = time.perf_counter()
            part = self.cache.pool.read_layer(layer, slots)
            self._parts.setdefault(seq.request_id, []).append(part)
            self._count_layer(layer, part.nbytes, start)

    def wait_for_save(self):
        """Assemble each save (whole `read` for kivi2), checksum it, hand it to the transport."""
        for seq, slots in self._bound.saves:
            if self._layerwise:
                parts = self._parts.pop(seq.request_id)
                require(len(parts) == self.cache.pool.spec.num_layers, "a layer went unsaved")
                stored = StoredKV.cat(parts)  # (layers, T, ...) per tensor
                self.stats.requests += 1
            else:
                start = time.perf_counter()
                stored = self.cache.pool.read(slots)
                self._count(stored.nbytes, time.perf_counter() - start)
            self.transport(seq, stored, checksum(stored))
        self._bound.saves = []

    def _step(self, walk: str, layer: int) -> None:
        require(layer == self._layer[walk] + 1, f"{walk} of layer {layer} out of layer order")
        self._layer[walk] = layer

    def _count_layer(self, layer: int, nbytes: int, start: float) -> None:
        """One layer's move of one request, begun at `start` (perf_counter)."""
        took = time.perf_counter() - start
        self.stats.layer_bytes[layer] += nbytes
        self.stats.layer_s[layer] += took
        self.stats.bytes += nbytes
        self.stats.seconds += took

    def _count(self, nbytes: int, took: float) -> None:
        self.stats.requests += 1
        self.stats.bytes += nbytes
        self.stats.seconds += took

    def check_integrity(self) -> None:
        """Nothing recorded and left unbuilt, nothing half-saved."""
        require(not self._loads and not self._saves, "connector work left unbuilt")
        require(not self._parts, "a save left half-assembled")
