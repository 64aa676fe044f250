"""`mlxcel serve` as a process under hostile clients and service managers: 200 stalled connections leave /health
fast, are cut at the header deadline and log a few lines, not one each; SIGTERM shuts down like Ctrl-C, ends every
live stream with an error event then [DONE] and every running request with a 503 in the envelope, and exits 0.
The hardening options reach the server config."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from mlxcel_cli.main import main
from mlxcel_core.server.http_config import HttpConfig

LISTENING = re.compile(r"listening on http://127\.0\.0\.1:(\d+)")


class Serve:
    """`mlxcel serve ARGS` on a free port, its stdout and stderr in a log file."""

    def __init__(self, tmp_path, *args):
        self.log_path = tmp_path / "serve.log"
        self.log = open(self.log_path, "w")
        command = [sys.executable, "-m", "mlxcel_cli.main", "serve", "--port", "0", "--no-warmup", *args]
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while not (match := LISTENING.search(self.output())):
            assert self.proc.poll() is None and time.monotonic() < deadline, self.output()
            time.sleep(0.05)
        self.url, self.port = f"http://127.0.0.1:{match.group(1)}", int(match.group(1))
        while not self._healthy():
            assert self.proc.poll() is None and time.monotonic() < deadline, self.output()
            time.sleep(0.1)

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    def output(self) -> str:
        return self.log_path.read_text()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


@pytest.fixture
def serve(tmp_path):
    started = []

    def start(*args) -> Serve:
        started.append(Serve(tmp_path, *args))
        return started[-1]

    yield start
    for process in started:
        process.close()


def test_stalled_connections_are_cut_and_logged_a_few_times(tiny_llama_dir, serve):
    server = serve("-m", str(tiny_llama_dir), "--header-timeout", "3")
    stalled = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(200)]
    for sock in stalled:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Ag")
    start = time.monotonic()
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    assert time.monotonic() - start < 1.0
    for sock in stalled:
        sock.settimeout(10)
        reply = b"".join(iter(lambda: sock.recv(4096), b""))  # until the server closes it
        assert reply.startswith(b"HTTP/1.1 408 ") and b'"code": 408' in reply, reply[:200]
        sock.close()
    for _ in range(30):  # not HTTP at all
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(b"HELLO THERE\r\n\r\n")
            assert b'"code": 400' in b"".join(iter(lambda: sock.recv(4096), b""))
    time.sleep(0.5)
    log = server.output()
    assert 1 <= log.count("did not arrive within 3 s") <= 5, log[-3000:]
    assert 1 <= log.count("Invalid HTTP request received") <= 5, log[-3000:]
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(30) == 0, server.output()


def both_running(url: str) -> bool:
    """Both requests are in the running batch (the non-streaming one shows nothing else before it ends)."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return any(
        line.startswith("llamacpp:requests_processing ") and float(line.split()[-1]) >= 2 for line in text.splitlines()
    )


def test_sigterm_ends_live_requests_with_errors_and_exits_0(tmp_path, serve):
    from tiny_models import save_tiny_llama

    model = save_tiny_llama(tmp_path / "long-context", max_position_embeddings=8192)
    server = serve("-m", str(model), "--shutdown-grace", "2", "--parallel", "2")
    long = {"prompt": "Hi", "max_tokens": 8000, "logit_bias": {"2": -100}}  # (EOS never comes)
    events, reply = [], {}

    def stream():
        with httpx.stream("POST", f"{server.url}/v1/completions", json={**long, "stream": True}, timeout=180) as r:
            for line in r.iter_lines():
                if line:
                    events.append((time.monotonic(), line))

    def whole():
        response = httpx.post(f"{server.url}/v1/completions", json=long, timeout=180)
        reply.update(status=response.status_code, body=response.json(), at=time.monotonic())

    workers = [threading.Thread(target=stream), threading.Thread(target=whole)]
    for worker in workers:
        worker.start()
    deadline = time.monotonic() + 120  # (a loaded CUDA machine compiles the first step's kernels first)
    while (len(events) < 3 or not both_running(server.url)) and time.monotonic() < deadline:  # both rows decode
        time.sleep(0.05)
    assert len(events) >= 3 and both_running(server.url) and not reply, server.output()
    sent = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    for worker in workers:
        worker.join(60)
    assert server.proc.wait(30) == 0, server.output()
    last_at, last = events[-1]
    assert last == "data: [DONE]"
    error = json.loads(events[-2][1].removeprefix("data: "))["error"]
    assert error["code"] == 503 and "shutting down" in error["message"] and "--shutdown-grace" in error["message"]
    assert all("choices" in json.loads(line.removeprefix("data: ")) for _, line in events[:-2])
    assert reply["status"] == 503 and reply["body"]["error"]["type"] == "unavailable_error"
    assert last_at - sent >= 1.8 and reply["at"] - sent >= 1.8  # they had the grace period to finish


@pytest.mark.parametrize(
    "args,message",
    [
        (["--max-body-size", "lots"], "--max-body-size: not a size"),
        (["--max-body-size", "0"], "--max-body-size must be at least 1 byte"),
        (["--header-timeout", "0"], "--header-timeout must be a number of seconds > 0"),
        (["--body-timeout", "-1"], "--body-timeout must be a number of seconds > 0"),
        (["--shutdown-grace", "-1"], "-1"),
        (["--max-connections", "0"], "--max-connections"),
    ],
)
def test_bad_hardening_flags_exit_2(args, message, capsys):
    assert main(["serve", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mlxcel: error: ") and message in err, err


def test_hardening_options_reach_the_server(monkeypatch):
    import mlxcel_core.server
    from mlxcel_core.errors import InputError

    seen = []

    def create_app(config, on_load_failed=None):
        seen.append(config)
        raise InputError("stopped before serving")

    monkeypatch.setattr(mlxcel_core.server, "create_app", create_app)
    monkeypatch.setattr("mlxcel_cli.serve._configure_logging", lambda log_format, verbose: None)
    monkeypatch.setenv("MLXCEL_SHUTDOWN_GRACE", "12.5")
    args = ["--max-body-size", "2M", "--header-timeout", "4", "--body-timeout", "9", "--max-connections", "300"]
    args += ["--allowed-origins", "https://a.example, http://*.lan:3000"]
    assert main(["serve", *args]) == 2
    http = seen[0].http
    assert (http.max_body_bytes, http.header_timeout, http.body_timeout) == (2 * 1024 * 1024, 4.0, 9.0)
    assert http.max_connections == 300 and http.shutdown_grace == 12.5
    assert http.allowed_origins == ("https://a.example", "http://*.lan:3000")
    monkeypatch.delenv("MLXCEL_SHUTDOWN_GRACE")
    for name in ("MAX_BODY_SIZE", "HEADER_TIMEOUT", "BODY_TIMEOUT", "MAX_CONNECTIONS", "ALLOWED_ORIGINS"):
        monkeypatch.delenv(f"MLXCEL_{name}", raising=False)
    assert main(["serve"]) == 2
    assert seen[1].http == HttpConfig()  # 16 MiB, 10 s, 60 s, 1024 connections, 5 s grace, localhost pages only
