"""Replicas as processes: N `kvlab serve` servers, each publishing its KV events, started
and stopped by the code that needs them (benchmarks, the notebook, tests).

    with ServeReplicas(3, config=PRECISE_CONFIG, budget="4096tok") as replicas:
        router = Router(replicas.backends(), policy="precise")

Each replica is `python -m kvlab serve` in a process group of its own on a free port,
with `--kv-events-config` binding its PUB and replay sockets on free ports; leaving the
block (or `stop()`) sends SIGTERM to each group, then SIGKILL to any that lingers.
Replicas compute on `threads` cores each (OMP_NUM_THREADS, torch's threads).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvlab.route.router import Backend

# vLLM's block hashes (sha256_cbor) so any subscriber can read them; hash prefix caching
REPLICA_CONFIG = {
    "cache": "paged",
    "prefix_caching": "hash",
    "prefix_caching_hash_algo": "sha256_cbor",
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ReplicaProcess:
    name: str
    port: int
    events_port: int
    replay_port: int
    process: subprocess.Popen
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def backend(self) -> Backend:
        return Backend(
            self.url,
            events=f"tcp://127.0.0.1:{self.events_port}",
            replay=f"tcp://127.0.0.1:{self.replay_port}",
            name=self.name,
        )


class ServeReplicas:
    """N `kvlab serve` processes; `configs` (one per replica) overrides `config`."""

    def __init__(
        self,
        n: int,
        config: dict | None = None,
        budget: str | None = None,
        model: str | None = None,
        threads: int = 1,
        max_model_len: int | None = None,
        configs: list[dict] | None = None,
        extra_args: tuple[str, ...] = (),
        start_timeout_s: float = 300.0,
        log_dir: str | None = None,
    ):
        if n < 1:
            raise ValueError(f"n={n} replicas: at least one")
        self.configs = configs or [config or REPLICA_CONFIG] * n
        if len(self.configs) != n:
            raise ValueError(f"{len(self.configs)} configs for {n} replicas")
        self.budget, self.model, self.threads = budget, model, threads
        self.max_model_len, self.extra_args = max_model_len, extra_args
        self.start_timeout_s = start_timeout_s
        self._tmp = None if log_dir else tempfile.TemporaryDirectory(prefix="kvlab-replicas-")
        self.log_dir = Path(log_dir or self._tmp.name)
        self.replicas: list[ReplicaProcess] = []

    def argv(self, config: dict, port: int, events: int, replay: int) -> list[str]:
        kv_events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{events}",
            "replay_endpoint": f"tcp://*:{replay}",
        }
        argv = [sys.executable, "-m", "kvlab", "serve", "--port", str(port),
                "--config", json.dumps(config), "--kv-events-config", json.dumps(kv_events),
                "--log-level", "warning", "--device", "cpu"]  # fmt: skip
        if self.budget:
            argv += ["--budget", self.budget]
        if self.model:
            argv += ["--model", self.model]
        if self.max_model_len:
            argv += ["--max-model-len", str(self.max_model_len)]
        return argv + list(self.extra_args)

    def start(self) -> ServeReplicas:
        env = {
            **os.environ,
            "OMP_NUM_THREADS": str(self.threads),
            "TOKENIZERS_PARALLELISM": "false",
        }
        try:
            for i, config in enumerate(self.configs):
                port, events, replay = free_port(), free_port(), free_port()
                log_path = self.log_dir / f"replica-{i}.log"
                with open(log_path, "w") as log:
                    process = subprocess.Popen(
                        self.argv(config, port, events, replay), stdout=log,
                        stderr=subprocess.STDOUT, env=env, start_new_session=True,
                    )  # fmt: skip
                self.replicas.append(
                    ReplicaProcess(f"r{i}", port, events, replay, process, log_path)
                )
            deadline = time.monotonic() + self.start_timeout_s
            for replica in self.replicas:
                self._wait_healthy(replica, deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self, replica: ReplicaProcess, deadline: float) -> None:
        while time.monotonic() < deadline:
            if replica.process.poll() is not None:
                tail = replica.log_path.read_text()[-2000:]
                raise RuntimeError(
                    f"replica {replica.name} exited ({replica.process.returncode}):\n{tail}"
                )
            try:
                if httpx.get(replica.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"replica {replica.name} did not answer /health in time")

    def backends(self) -> list[Backend]:
        return [r.backend() for r in self.replicas]

    def reset_prefix_caches(self) -> None:
        """POST /reset_prefix_cache to every replica (each reports AllBlocksCleared)."""
        for replica in self.replicas:
            answer = httpx.post(replica.url + "/reset_prefix_cache", timeout=30)
            if answer.status_code != 200:
                raise RuntimeError(f"{replica.name}: reset_prefix_cache {answer.status_code}")

    def stop(self) -> None:
        for replica in self.replicas:
            if replica.process.poll() is None:
                os.killpg(replica.process.pid, signal.SIGTERM)
        for replica in self.replicas:
            try:
                replica.process.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(replica.process.pid, signal.SIGKILL)
                replica.process.wait()
        self.replicas = []
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> ServeReplicas:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
