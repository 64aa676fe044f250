"""A real `mlxcel serve` app under uvicorn on a free loopback port, in a thread of the test process.

Only one server computes at a time (MLX is driven from each server's one engine thread); a test that
needs other settings starts its own with `start_server` while another server sits idle. A plain module (not a
conftest) so that tests outside tests/mlxcel_core/server/ (the per-family checks) start servers too.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import httpx

from mlxcel_core.engine import EngineConfig
from mlxcel_core.server import ServerConfig, create_app
from mlxcel_core.server.connections import uvicorn_server
from mlxcel_core.server.http_config import HttpConfig

TIMEOUT = httpx.Timeout(30.0, connect=5.0)


@dataclass
class RunningServer:
    url: str
    app: object
    uvicorn_server: object
    thread: threading.Thread

    @property
    def state(self):  # mlxcel_core.server.app.Server
        return self.app.state.server

    @property
    def model_id(self) -> str:
        return self.state.model_id

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kw.pop("timeout", TIMEOUT), **kw)

    def metrics(self) -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics", timeout=TIMEOUT, headers=self.auth_headers()).text
        return {
            f"{s.name}{_labels(s.labels)}": s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def auth_headers(self) -> dict:
        key = self.state.config.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def wait_for(self, predicate, timeout: float = 10.0, what: str = "condition"):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.05)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}")

    def wait_ready(self, timeout: float) -> None:
        """Until /health turns 200 (the model loaded, the warm-up done). Each probe waits up to TIMEOUT's 30 s: while
        the model loads, a step that holds the GIL (the tokenizers library builds a large vocabulary's BPE under it,
        about a second on an idle CI core) delays the answer, several times longer on a loaded machine."""
        self.wait_for(lambda: httpx.get(f"{self.url}/health", timeout=TIMEOUT).status_code == 200, timeout, "the load")

    def stop(self) -> None:
        self.uvicorn_server.should_exit = True
        self.thread.join(20)
        assert not self.thread.is_alive(), "server thread did not stop"


def _labels(labels: dict) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else ""


def start_server(model_dir, *, max_batch_size: int = 8, wait_ready: bool = True, load=None, **config) -> RunningServer:
    """`config`: ServerConfig's fields; `http` (HttpConfig) defaults to a 2 s shutdown grace."""
    engine = config.pop("engine", None) or EngineConfig(max_batch_size=max_batch_size)
    config.setdefault("http", HttpConfig(shutdown_grace=2.0))
    server_config = ServerConfig(model=str(model_dir), engine=engine, **config)
    app = create_app(server_config, load=load)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn_server(app)  # the protocol, limits and graceful shutdown of `mlxcel serve`
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="uvicorn-test")
    thread.start()
    running = RunningServer(f"http://127.0.0.1:{port}", app, server, thread)
    running.wait_for(lambda: server.started, 15, "uvicorn to start")
    if wait_ready:
        running.wait_ready(60)
    return running
