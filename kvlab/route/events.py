"""Subscribing to replicas' KV events: vLLM's ZMQ wire format, from kvlab or vLLM alike.

A replica publishes (topic, sequence number, payload) on a PUB socket; the payload is
msgpack of [ts, [event maps], data_parallel_rank] (kvlab.serve.kv_events says more). An
`EventSubscriber` runs one thread with a SUB socket per replica and hands each event map,
in order, to a callback. With a replica's replay endpoint (vLLM's ROUTER socket) it first
asks for every batch the replica still buffers (so events sent before the subscription
took hold are not lost: ZMQ's slow joiner), then asks again for any gap in the sequence
numbers it sees.

    sub = EventSubscriber(on_event=index.apply)
    sub.add("r0", "tcp://127.0.0.1:5557", replay="tcp://127.0.0.1:5558")
    sub.start() ... sub.stop()
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("kvlab.route.events")
END_SEQ = -1


def decode_payload(payload: bytes) -> tuple[float, list[dict]]:
    """A KVEventBatch payload -> (ts, event maps)."""
    import msgpack

    batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    return float(batch[0]), list(batch[1])


@dataclass
class Feed:
    """One replica's stream: its sockets and how far it has been read."""

    replica: str
    endpoint: str
    replay: str | None = None
    topic: str = ""
    last_seq: int = -1  # the last batch handed on
    batches: int = 0
    events: int = 0
    gaps: int = 0  # sequence gaps seen (replayed when a replay endpoint is known)
    sub: object = None
    dealer: object = None
    log: list[tuple[float, str]] = field(default_factory=list)  # (ts, event type), if kept


class EventSubscriber:
    """Reads every replica's KV events on one thread; `on_event(replica, event)` runs there."""

    def __init__(self, on_event: Callable[[str, dict], None], keep_log: bool = False):
        import zmq

        self.on_event = on_event
        self.keep_log = keep_log
        self.feeds: dict[str, Feed] = {}
        self._context = zmq.Context()
        self._lock = threading.Lock()  # held while an event is applied (readers may take it)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvlab-route-events", daemon=True)

    @property
    def lock(self) -> threading.Lock:
        return self._lock

    def add(self, replica: str, endpoint: str, replay: str | None = None, topic: str = "") -> None:
        """Subscribe to `replica`'s events (before `start`)."""
        import zmq

        feed = Feed(replica, endpoint, replay, topic)
        feed.sub = self._context.socket(zmq.SUB)
        feed.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        feed.sub.connect(endpoint)
        if replay:
            feed.dealer = self._context.socket(zmq.DEALER)
            feed.dealer.connect(replay)
        self.feeds[replica] = feed

    def start(self) -> EventSubscriber:
        for feed in self.feeds.values():
            if feed.dealer is not None:
                self._replay(feed, 0)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        for feed in self.feeds.values():
            for socket in (feed.sub, feed.dealer):
                if socket is not None:
                    socket.close(linger=0)
        self._context.term()

    def __enter__(self) -> EventSubscriber:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait_quiet(self, quiet_s: float = 0.3, timeout_s: float = 10.0) -> None:
        """Return once no batch has arrived for `quiet_s` (the replicas are idle)."""
        deadline = time.monotonic() + timeout_s
        seen = -1
        while time.monotonic() < deadline:
            now = sum(f.batches for f in self.feeds.values())
            if now == seen:
                return
            seen = now
            time.sleep(quiet_s)

    # --- the subscriber's thread ------------------------------------------------------
    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        for feed in self.feeds.values():
            poller.register(feed.sub, zmq.POLLIN)
        by_socket = {feed.sub: feed for feed in self.feeds.values()}
        while not self._stop.is_set():
            for socket, _ in poller.poll(100):
                feed = by_socket[socket]
                _topic, seq, payload = socket.recv_multipart()
                self._take(feed, int.from_bytes(seq, "big", signed=True), payload)

    def _take(self, feed: Feed, seq: int, payload: bytes) -> None:
        if seq <= feed.last_seq:
            return  # replayed already
        if seq > feed.last_seq + 1:
            feed.gaps += 1
            if feed.dealer is not None:
                self._replay(feed, feed.last_seq + 1)
                if seq <= feed.last_seq:
                    return
            else:
                log.warning(
                    "%s: KV event batches %d..%d lost", feed.replica, feed.last_seq + 1, seq - 1
                )
        self._apply(feed, seq, payload)

    def _apply(self, feed: Feed, seq: int, payload: bytes) -> None:
        ts, events = decode_payload(payload)
        with self._lock:
            for event in events:
                self.on_event(feed.replica, event)
                if self.keep_log:
                    feed.log.append((ts, event.get("type")))
        feed.last_seq = seq
        feed.batches += 1
        feed.events += len(events)

    def _replay(self, feed: Feed, start: int, timeout_s: float = 5.0) -> None:
        """Ask the replica for its buffered batches from `start` on and apply them."""
        import zmq

        feed.dealer.send_multipart((b"", start.to_bytes(8, "big")))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not feed.dealer.poll(100, zmq.POLLIN):
                continue
            frames = feed.dealer.recv_multipart()
            _, _topic, seq, payload = frames
            seq = int.from_bytes(seq, "big", signed=True)
            if seq == END_SEQ:
                return
            if seq > feed.last_seq:
                self._apply(feed, seq, payload)
        log.warning(
            "%s: no end of replay from %s within %.0f s", feed.replica, feed.replay, timeout_s
        )
