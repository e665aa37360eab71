"""A KV connector: the interface between the engine and KV stored outside the device
pool, with the method names of vLLM's (vllm/distributed/kv_transfer/kv_connector/v1/base.py),
so a learner who reads kvlab's can read vLLM's.

vLLM splits a connector in two roles, one object in each process:

    scheduler side                          worker side (around the forward)
    get_num_new_matched_tokens(req, n)      bind_connector_metadata(meta)
    update_state_after_alloc(req, blocks,   start_load_kv()   before the forward
                             num_external)  wait_for_layer_load(layer)   per layer
    build_connector_meta() -> meta          save_kv_layer(layer)   per layer
    request_finished(req, block_ids)        wait_for_save()   after the forward

kvlab runs both roles in one process, synchronously: when the scheduler admits a request,
`TierConnector.promote` (kvlab/cache/tiers/connector.py) asks how many tokens the tiers
hold, allocates device blocks, builds the metadata and runs the worker side at once, layer
by layer: `wait_for_layer_load(i)` writes layer i of every loaded block into the pool and
`save_kv_layer(i)` reads layer i of every block to save, and `wait_for_save` puts a saved
block's layers together for the tiers (codecs with `layerwise`; kivi2's windows span layers,
so its blocks move whole). The loads finish before the scheduling call returns; vLLM makes
the per-layer calls inside the forward, overlapping layer i's load with layer i-1's compute.
Saves happen when a block is evicted (write-back) or its request is released
(write-through).

`PrefillDecodeConnector` (kvlab/disagg/connector.py) moves a prefilled request between two
engines, with vLLM's P/D roles: on the prefill engine the "kv_producer" (`request_finished`
saves the request's KV layer by layer, `wait_for_save` sends it), on the decode engine the
"kv_consumer" (`get_num_new_matched_tokens` counts an arrived intact transfer's tokens,
`wait_for_layer_load` restores it layer by layer into the blocks swap-in allocated). Each
connector fills `ConnectorMeta` with its own entries (vLLM subclasses its metadata).
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from kvlab.sequence import Sequence


@dataclass
class ConnectorMeta:
    """What the worker side must do this step: KV to load and KV to save, as entries the
    connector defines (TierConnector's below; PrefillDecodeConnector's are per request)."""

    loads: list[tuple] = field(default_factory=list)  # TierConnector: block, codes, tier
    saves: list[tuple] = field(default_factory=list)  # TierConnector: block, key, salt,
    # everywhere (write-through) or the first tier only (write-back)


class KVConnector(ABC):
    """The interface, both roles (vLLM's KVConnectorBase_V1, with kvlab's types)."""

    # --- scheduler side -------------------------------------------------------------
    @abstractmethod
    def get_num_new_matched_tokens(
        self, seq: Sequence, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Tokens beyond the device's `num_computed_tokens` that the connector can supply,
        and whether they arrive asynchronously (kvlab: never)."""

    @abstractmethod
    def update_state_after_alloc(
        self, seq: Sequence, blocks: list[int], num_external_tokens: int
    ) -> None:
        """Device `blocks` were allocated for `seq`'s external tokens: remember to load them."""

    @abstractmethod
    def build_connector_meta(self) -> ConnectorMeta:
        """Hand the worker side what to load and save, and reset the scheduler's record."""

    @abstractmethod
    def request_finished(self, seq: Sequence, block_ids: list[int]) -> tuple[bool, dict | None]:
        """`seq` releases its blocks: save what the policy saves. Returns (the blocks must
        stay until an asynchronous save ends: kvlab never, extra output params)."""

    # --- worker side ----------------------------------------------------------------
    @abstractmethod
    def bind_connector_metadata(self, meta: ConnectorMeta) -> None:
        """Hand the worker side the metadata the scheduler side built for this step."""

    @abstractmethod
    def start_load_kv(self) -> None:
        """Start loading the bound metadata's blocks into the device pool."""

    @abstractmethod
    def wait_for_layer_load(self, layer: int) -> None:
        """Block until `layer`'s share of the loads is in the pool."""

    @abstractmethod
    def save_kv_layer(self, layer: int) -> None:
        """Start saving `layer`'s share of the bound metadata's saves."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Block until every save of the bound metadata is done."""

    def run_worker(self, num_layers: int) -> None:
        """kvlab's one-process shortcut: run the worker side on the scheduler side's
        metadata at once, layer by layer as a forward would (vLLM makes these calls inside
        each attention layer, so layer i's load overlaps layer i-1's compute)."""
        self.bind_connector_metadata(self.build_connector_meta())
        self.start_load_kv()
        for layer in range(num_layers):
            self.wait_for_layer_load(layer)  # a forward would run layer `layer` here
            self.save_kv_layer(layer)
        self.wait_for_save()


SCHEDULER_SIDE = ("get_num_new_matched_tokens", "update_state_after_alloc",
                  "build_connector_meta", "request_finished")  # fmt: skip
WORKER_SIDE = ("bind_connector_metadata", "start_load_kv", "wait_for_layer_load",
               "save_kv_layer", "wait_for_save")  # fmt: skip


def method_table(connector: KVConnector) -> list[tuple[str, str, str]]:
    """(side, method, first line of its docstring) for every method of the interface, as
    `connector`'s class documents it (or the interface, where it adds nothing)."""
    rows = []
    for side, names in (("scheduler", SCHEDULER_SIDE), ("worker", WORKER_SIDE)):
        for name in names:
            doc = inspect.getdoc(getattr(type(connector), name)) or ""
            rows.append((side, name, doc.splitlines()[0] if doc else ""))
    return rows
