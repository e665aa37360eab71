"""Start a server: an engine, its loop thread, the app, uvicorn.

kvlab serve --config paged+prefix --port 8000            # the embedded model
kvlab serve --api-keys-file keys.json --tenant-max-running 4   # tenants (kvlab.serve.tenants)
with ServerThread(engine) as server:                     # tests: a free port, a thread
    openai.OpenAI(base_url=server.url + "/v1", api_key="x")...
"""

from __future__ import annotations

import json
import logging
import socket
import threading

import uvicorn

from kvlab.build import Engine
from kvlab.config import EngineConfig
from kvlab.engine.capacity import kv_capacity
from kvlab.serve.app import build_app
from kvlab.serve.encoder import Encoder
from kvlab.serve.kv_events import KVEventPublisher
from kvlab.serve.limits import ServeLimits
from kvlab.serve.loop import EngineLoop
from kvlab.serve.metrics import ServeMetrics
from kvlab.serve.tenants import Tenants

log = logging.getLogger("kvlab.serve")
DEFAULT_CONFIG = "paged+prefix"  # paged blocks and hash prefix caching, as vLLM serves


def engine_config(text: str | None, **base) -> EngineConfig:
    """An EngineConfig from a config name ("paged+prefix+watermark") or a JSON object of
    EngineConfig fields ('{"cache": "paged", "prefix_caching": "radix"}'); `base`
    fields (budget, max_model_len) apply under either."""
    from kvlab.presets import parse_config

    text = (text or DEFAULT_CONFIG).strip()
    if text.startswith("{"):
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"--config is not valid JSON: {error}") from None
        if not isinstance(fields, dict):
            raise ValueError("--config JSON must be an object of EngineConfig fields")
        try:
            return EngineConfig(**{**base, **fields})
        except TypeError as error:
            raise ValueError(f"--config: {error}") from None
    return parse_config(text, **base)


class Server:
    """One engine served over HTTP: `app` for uvicorn, `loop` owning the engine; API keys
    and their tenants (`tenants`, none: open) and request limits (`limits`)."""

    def __init__(
        self,
        engine: Engine,
        model_name: str | None = None,
        tenants: Tenants | None = None,
        limits: ServeLimits | None = None,
        kv_events: KVEventPublisher | None = None,
    ):
        """`kv_events`: the publisher the engine was built with (Engine(..., kv_events=));
        the server batches its events per step and closes it when it stops."""
        self.engine = engine
        self.model_name = model_name or engine.model.name
        self.metrics = ServeMetrics(self.model_name, engine)
        self.kv_events = kv_events
        self.loop = EngineLoop(engine, self.metrics, kv_events)
        self.encoder = Encoder(engine.tokenizer)
        self.app = build_app(
            self.loop, self.metrics, self.model_name, self.encoder, tenants, limits
        )

    def log_startup(self) -> None:
        for line in kv_capacity(self.engine).lines():
            log.info(line)
        if self.kv_events is not None:
            log.info("KV events: publishing on %s", self.kv_events.endpoint)

    def close(self) -> None:
        """Stop the engine loop, the encoder and the KV event publisher."""
        self.loop.stop()
        self.encoder.close()
        if self.kv_events is not None:
            self.kv_events.close()

    def run(self, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
        """Serve until interrupted (Ctrl-C)."""
        self.loop.start()
        try:
            uvicorn.run(self.app, host=host, port=port, log_level=log_level)
        finally:
            self.close()


def free_socket(host: str = "127.0.0.1") -> socket.socket:
    """A listening TCP socket on a free port (no race between choosing and binding)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(128)
    return sock


class ServerThread:
    """A server in a background thread on a free loopback port, for tests and notebooks.

    `with ServerThread(engine) as server: ... server.url ...`; leaving stops both threads.
    """

    def __init__(self, engine: Engine, model_name=None, log_level="warning", **options):
        self.server = Server(engine, model_name, **options)  # tenants=, limits=
        self.socket = free_socket()
        host, port = self.socket.getsockname()[:2]
        self.url = f"http://{host}:{port}"
        config = uvicorn.Config(self.server.app, log_level=log_level, timeout_graceful_shutdown=2)
        self.uvicorn = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._serve, name="kvlab-http", daemon=True)

    @property
    def loop(self) -> EngineLoop:
        return self.server.loop

    def _serve(self) -> None:
        self.uvicorn.run(sockets=[self.socket])

    def start(self) -> ServerThread:
        self.server.loop.start()
        self._thread.start()
        while not self.uvicorn.started:
            if not self._thread.is_alive():
                raise RuntimeError("the HTTP server thread died at start-up")
            self._thread.join(0.02)
        return self

    def stop(self) -> None:
        self.uvicorn.should_exit = True
        self._thread.join(10)
        self.server.close()
        self.socket.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
