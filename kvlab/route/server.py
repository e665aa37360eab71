"""Run the router: `RouterThread` (tests, notebooks: a thread on a free loopback port) or
`run_router` (the `kvlab route` command: uvicorn in the foreground)."""

from __future__ import annotations

import socket
import threading

import uvicorn

from kvlab.route.app import build_app
from kvlab.route.router import Router


def load_tokenizer(path: str | None):
    """The backends' tokenizer (for chat templates and text prompts): a local directory
    or hub id; None: the embedded model's cached copy, if there is one; "none": no
    tokenizer (only token-id prompts get token hashes)."""
    if path == "none":
        return None
    from transformers import AutoTokenizer

    if path is None:
        from kvlab.model.loading import EMBEDDED_MODEL, cache_dir

        local = cache_dir() / "models" / EMBEDDED_MODEL
        if not local.is_dir():
            return None
        path = str(local)
    return AutoTokenizer.from_pretrained(path)


def _free_socket(host: str = "127.0.0.1") -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(128)
    return sock


class RouterThread:
    """`with RouterThread(router) as r: ... r.url ...`: the router in a thread on a free
    loopback port; leaving stops it (and its event subscriber)."""

    def __init__(self, router: Router, log_level: str = "warning"):
        self.router = router
        self.socket = _free_socket()
        host, port = self.socket.getsockname()[:2]
        self.url = f"http://{host}:{port}"
        config = uvicorn.Config(build_app(router), log_level=log_level, timeout_graceful_shutdown=2)
        self.uvicorn = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._serve, name="kvlab-route", daemon=True)

    def _serve(self) -> None:
        self.uvicorn.run(sockets=[self.socket])

    def start(self) -> RouterThread:
        self._thread.start()
        while not self.uvicorn.started:
            if not self._thread.is_alive():
                raise RuntimeError("the router's HTTP thread died at start-up")
            self._thread.join(0.02)
        return self

    def stop(self) -> None:
        self.uvicorn.should_exit = True
        self._thread.join(10)
        self.socket.close()

    def __enter__(self) -> RouterThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def run_router(router: Router, host: str = "127.0.0.1", port: int = 8080, log_level="info"):
    """Serve until interrupted (Ctrl-C)."""
    uvicorn.run(build_app(router), host=host, port=port, log_level=log_level)
