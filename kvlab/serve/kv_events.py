"""KV events over ZMQ, as vLLM publishes them (`vllm serve --kv-events-config`).

    kvlab serve --config '{"cache": "paged", "prefix_caching": "hash",
                           "prefix_caching_hash_algo": "sha256_cbor"}' \\
        --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
                             "endpoint": "tcp://*:5557", "topic": "kv-events"}'

The engine's hash index reports each block it stores or removes (kvlab.cache.events) to
the `KVEventPublisher` it was built with, on the engine thread; after every step the loop
hands what the step reported over as one batch, and the publisher's thread sends it. The
wire format is vLLM's (vllm/distributed/kv_events.py, 0.32):

- a PUB socket sends multipart messages (topic, sequence number as 8 bytes big-endian,
  payload); an optional ROUTER socket (`replay_endpoint`) answers a request for the
  batches from sequence number N (8 bytes big-endian) with each buffered one, then an
  end marker (sequence -1 and an empty payload);
- the payload is msgpack of a `KVEventBatch`, an array [ts, events, data_parallel_rank];
  each event a map tagged by "type" with vLLM's fields in vLLM's order: `BlockStored`
  (block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name,
  extra_keys, group_idx), `BlockRemoved` (block_hashes, medium, group_idx),
  `AllBlocksCleared`;
- block hashes are integers, the last 8 bytes of the hash read big-endian
  (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, vLLM's default), or the raw bytes with
  `int_block_hashes=False`; medium is "GPU", vLLM's name for the engine's own KV pool
  whatever the device (its CPU build says "GPU" too).

With prefix_caching_hash_algo="sha256_cbor" the hashes are vLLM's for the same tokens,
block size and cache_salt, so one subscriber reads kvlab and vLLM replicas alike.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, fields
from itertools import count

from kvlab.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

log = logging.getLogger("kvlab.serve.kv_events")
MEDIUM = "GPU"  # vLLM's MEDIUM_GPU: the engine's own KV pool
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's end marker


@dataclass
class KVEventsConfig:
    """vLLM's KVEventsConfig (vllm/config/kv_events.py): the same fields and defaults."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"; None: "zmq" if enabled
    endpoint: str = "tcp://*:5557"  # bound if it has "*", "::", ipc:// or inproc://
    replay_endpoint: str | None = None  # a ROUTER socket replaying buffered batches
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark
    max_queue_size: int = 100_000  # batches waiting for the publisher's thread
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"--kv-events-config publisher={self.publisher!r}: 'zmq' or 'null'")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--kv-events-config {name}={getattr(self, name)} must be >= 1")

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """The flag's JSON object (vLLM's keys; an unknown key is an error)."""
        try:
            values = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"--kv-events-config is not valid JSON: {error}") from None
        if not isinstance(values, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"--kv-events-config: unknown keys {unknown}; known: {sorted(known)}")
        return cls(**values)

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


def external_hash(digest: bytes, as_int: bool = True) -> int | bytes:
    """vLLM's `maybe_convert_block_hash`: the hash's last 8 bytes as an unsigned integer
    (its default), or the bytes themselves."""
    return int.from_bytes(digest, "big") & ((1 << 64) - 1) if as_int else digest


def wire_event(event: KVEvent, as_int: bool = True) -> dict:
    """One event as vLLM's msgspec encodes it: a map, "type" first, then its fields in
    vLLM's order, fields at their None default left out."""
    if isinstance(event, BlockStored):
        parent = event.parent_block_hash
        return {
            "type": "BlockStored",
            "block_hashes": [external_hash(h, as_int) for h in event.block_hashes],
            "parent_block_hash": None if parent is None else external_hash(parent, as_int),
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": None,
            "medium": MEDIUM,
            "lora_name": None,
            "extra_keys": [None if k is None else list(k) for k in event.extra_keys],
            "group_idx": event.group_idx,
        }
    if isinstance(event, BlockRemoved):
        return {
            "type": "BlockRemoved",
            "block_hashes": [external_hash(h, as_int) for h in event.block_hashes],
            "medium": MEDIUM,
            "group_idx": event.group_idx,
        }
    if isinstance(event, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV event: {event!r}")


def encode_batch(ts: float, events: list[KVEvent], rank: int = 0, as_int: bool = True) -> bytes:
    """A KVEventBatch payload: msgpack of [ts, [event maps], data_parallel_rank]."""
    import msgpack

    return msgpack.packb([float(ts), [wire_event(e, as_int) for e in events], rank])


def decode_batch(payload: bytes) -> tuple[float, list[dict], int | None]:
    """A payload back to (ts, event maps, data_parallel_rank): kvlab's or vLLM's."""
    import msgpack

    batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    return batch[0], batch[1], (batch[2] if len(batch) > 2 else None)


class KVEventPublisher:
    """The engine's event sink and a ZMQ publisher (vLLM's ZmqEventPublisher).

    `__call__(event)` and `end_step()` run on the engine thread; a thread of its own sends
    the batches (and serves replays), so a slow subscriber never stalls a step."""

    def __init__(self, config: KVEventsConfig, rank: int = 0, int_block_hashes: bool = True):
        import zmq

        self.config, self.rank, self.int_block_hashes = config, rank, int_block_hashes
        self._pending: list[KVEvent] = []  # this step's events (engine thread)
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = count()
        self._topic = config.topic.encode()
        self.batches = self.events = 0  # published so far
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self.endpoint = self._open(self._pub, config.endpoint)
        self._replay = None
        self.replay_endpoint = None
        if config.replay_endpoint:
            self._replay = self._context.socket(zmq.ROUTER)
            self.replay_endpoint = self._open(self._replay, config.replay_endpoint, bind=True)
        self._thread = threading.Thread(target=self._run, name="kvlab-kv-events", daemon=True)
        self._thread.start()

    @staticmethod
    def _open(socket, endpoint: str, bind: bool | None = None) -> str:
        """Bind (wildcards, ipc://, inproc://) or connect, as vLLM does; the bound address
        (a port 0 resolved, "*" as 127.0.0.1 for local subscribers)."""
        import zmq

        if bind is None:
            bind = "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc:", "inproc:"))
        if not bind:
            socket.connect(endpoint)
            return endpoint
        socket.bind(endpoint)
        bound = socket.getsockopt_string(zmq.LAST_ENDPOINT)
        return bound.replace("0.0.0.0", "127.0.0.1")

    # --- the engine thread ---------------------------------------------------------------
    def __call__(self, event: KVEvent) -> None:
        self._pending.append(event)

    def end_step(self) -> None:
        """Send what the cache reported since the last call as one KVEventBatch."""
        if not self._pending:
            return
        events, self._pending = self._pending, []
        try:
            self._queue.put_nowait((time.time(), events))
        except queue.Full:
            log.warning("KV events: the queue is full, %d events dropped", len(events))

    # --- the publisher's thread ----------------------------------------------------------
    def _run(self) -> None:
        import zmq

        while True:
            if self._replay is not None and self._replay.poll(0, zmq.POLLIN):
                self._serve_replay()
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                return
            ts, events = item
            payload = encode_batch(ts, events, self.rank, self.int_block_hashes)
            seq = next(self._seq)
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
            self.batches += 1
            self.events += len(events)

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("KV events: a replay request of %d frames ignored", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart(
                    (client, b"", self._topic, seq.to_bytes(8, "big"), payload)
                )
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (up to `timeout`), then close the sockets."""
        self.end_step()
        self._queue.put(None)
        self._thread.join(timeout)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._context.term()

    def describe(self) -> dict:
        return {**asdict(self.config), "bound": self.endpoint, "replay_bound": self.replay_endpoint}


def kv_events_publisher(flag: str | None) -> KVEventPublisher | None:
    """The publisher `--kv-events-config FLAG` asks for, or None (no flag, or disabled)."""
    if not flag:
        return None
    config = KVEventsConfig.from_json(flag)
    return KVEventPublisher(config) if config.enabled else None
