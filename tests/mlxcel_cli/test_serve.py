"""`mlxcel serve` as a process: port 0, health while loading, API key and env vars, JSON logs, clean exits."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from mlxcel_cli.main import main

LISTENING = re.compile(r"listening on http://127\.0\.0\.1:(\d+)")


class ServeProcess:
    def __init__(self, tmp_path, *args, env=None):
        self.log = tmp_path / "serve.log"
        self.handle = open(self.log, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlxcel_cli.main", "serve", *args],
            stdout=self.handle,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
        )
        self.url = None

    def output(self) -> str:
        return self.log.read_text()

    def wait_listening(self, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = LISTENING.search(self.output())
            if match:
                self.url = f"http://127.0.0.1:{match.group(1)}"
                return self.url
            assert self.proc.poll() is None, self.output()
            time.sleep(0.05)
        raise AssertionError(f"no 'listening on' line: {self.output()}")

    def wait_healthy(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.ConnectError:  # (not accepting yet, or gone: then say why)
                assert self.proc.poll() is None, f"the server exited: {self.output()}"
            time.sleep(0.05)
        raise AssertionError(f"never healthy: {self.output()}")

    def stop(self, timeout: float = 20) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(5)
            self.handle.close()


@pytest.fixture
def serve_process(tmp_path):
    started = []

    def start(*args, env=None) -> ServeProcess:
        process = ServeProcess(tmp_path, *args, env=env)
        started.append(process)
        return process

    yield start
    for process in started:
        process.stop()


def test_serve_end_to_end_with_env_vars_api_key_and_json_logs(tiny_llama_dir, serve_process):
    env = {"MLXCEL_API_KEY": "k3y", "MLXCEL_MAX_N": "1", "MLXCEL_LOG_FORMAT": "json", "MLXCEL_MAX_BATCH_SIZE": "2"}
    server = serve_process("-m", str(tiny_llama_dir), "--port", "0", env=env)
    url = server.wait_listening()
    server.wait_healthy()
    auth = {"Authorization": "Bearer k3y"}
    with httpx.Client(base_url=url, timeout=30) as http:
        assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 401
        ok = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, headers=auth)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 2
        produced = ok.json()["usage"]["completion_tokens"]  # (2, or fewer where the sampled text ends early)
        too_many = http.post("/v1/completions", json={"prompt": "Hi", "n": 2}, headers=auth)
        assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"  # MLXCEL_MAX_N=1
        models = http.get("/v1/models", headers=auth).json()
        assert models["data"][0]["id"] == str(tiny_llama_dir)
    assert server.stop() == 130  # Ctrl-C: graceful shutdown, then the documented "interrupted" status
    lines = server.output().splitlines()
    start = next(i for i, line in enumerate(lines) if LISTENING.search(line))
    assert lines[-1] == "mlxcel: interrupted"
    records = [json.loads(line) for line in lines[start + 1 : -1] if line.strip()]
    assert {"time", "level", "logger", "message"} <= set(records[0])
    assert any("model ready" in r["message"] for r in records)
    served = [r["message"] for r in records if r["logger"] == "mlxcel.server"]
    assert any(f"completion {produced} tokens" in m for m in served), served


def test_health_is_503_until_the_model_is_loaded(tiny_llama_dir, serve_process):
    server = serve_process("-m", str(tiny_llama_dir), "--port", "0")
    url = server.wait_listening()
    statuses = set()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        response = httpx.get(f"{url}/health", timeout=5)
        statuses.add(response.status_code)
        if response.status_code == 503:
            assert response.json()["error"]["message"] == "Loading model"
        if response.status_code == 200:
            break
        time.sleep(0.01)
    assert 200 in statuses  # 503 is seen too unless loading beat the first probe


def test_a_model_that_fails_to_load_exits_2(tmp_path, serve_process):
    server = serve_process("-m", str(tmp_path / "nope"), "--port", "0")
    assert server.proc.wait(60) == 2
    assert "mlxcel: error:" in server.output() and "does not exist" in server.output()


def test_a_draft_model_with_another_vocabulary_exits_2(tiny_llama_dir, tmp_path, serve_process):
    import shutil

    from tiny_models import build_tokenizer

    other = tmp_path / "other-vocab"
    shutil.copytree(tiny_llama_dir, other)
    build_tokenizer(vocab_size=300).save(str(other / "tokenizer.json"))
    server = serve_process("-m", str(tiny_llama_dir), "--draft-model", str(other), "--port", "0")
    assert server.proc.wait(60) == 2
    assert "mlxcel: error: draft model" in server.output() and "different vocabulary" in server.output()


def test_a_busy_port_exits_2(tiny_llama_dir, serve_process):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        server = serve_process("-m", str(tiny_llama_dir), "--port", str(port))
        assert server.proc.wait(60) == 2
    assert "cannot listen on 127.0.0.1" in server.output()


def test_help_lists_every_flag_with_its_env_var(capsys):
    assert main(["serve", "--help"]) == 0
    out = capsys.readouterr().out
    for flag, env in [
        ("--model", "MLXCEL_MODEL"),
        ("--host", "MLXCEL_HOST"),
        ("--port", "MLXCEL_PORT"),
        ("--api-key", "MLXCEL_API_KEY"),
        ("--parallel", "MLXCEL_PARALLEL"),
        ("--n-parallel", None),
        ("--max-batch-size", "MLXCEL_MAX_BATCH_SIZE"),
        ("--max-queue-depth", "MLXCEL_MAX_QUEUE_DEPTH"),
        ("--prefill-chunk-size", "MLXCEL_PREFILL_CHUNK_SIZE"),
        ("--prefill-batch", "MLXCEL_PREFILL_BATCH"),
        ("--decode-storage-backend", "MLXCEL_DECODE_STORAGE_BACKEND"),
        ("--ctx-size", "MLXCEL_CTX_SIZE"),
        ("--max-n", "MLXCEL_MAX_N"),
        ("--kv-bits", "MLXCEL_KV_BITS"),
        ("--log-format", "MLXCEL_LOG_FORMAT"),
        ("--draft-model", "MLXCEL_DRAFT_MODEL"),
        ("--draft-ngram", "MLXCEL_DRAFT_NGRAM"),
        ("--num-draft-tokens", "MLXCEL_NUM_DRAFT_TOKENS"),
        ("--no-warmup", "MLXCEL_WARMUP"),
    ]:
        assert flag in out
        if env:
            assert env in re.sub(r"\s+", "", out), env


@pytest.mark.parametrize(
    "args,message",
    [
        (["--log-format", "xml"], "--log-format must be text or json"),
        (["--kv-bits", "3"], "--kv-bits must be 4 or 8"),
        (["--decode-storage-backend", "disk"], "--decode-storage-backend must be"),
        (["--port", "70000"], "70000"),
        (["--max-batch-size", "0"], "--max-batch-size"),
        (["--prefill-batch", "0"], "--prefill-batch"),
        (["--draft-ngram", "2", "--num-draft-tokens", "0"], "num-draft-tokens must be"),
        (["--draft-ngram", "2", "--draft-model", "x"], "not both"),
    ],
)
def test_bad_flags_exit_2_with_one_line(args, message, capsys):
    assert main(["serve", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mlxcel: error: ") and message in err, err


def _served_config(monkeypatch, args, env: dict):
    """The ServerConfig `mlxcel serve ARGS` builds under `env` (None: unset), stopped before it serves."""
    import mlxcel_cli.serve as serve_module
    import mlxcel_core.server
    from mlxcel_core.errors import InputError

    seen = []

    def create_app(config, on_load_failed=None):
        seen.append(config)
        raise InputError("stopped before serving")

    monkeypatch.setattr(mlxcel_core.server, "create_app", create_app)
    # (serve's logging setup stops the "mlxcel" logger's propagation: later tests' caplog would see nothing)
    monkeypatch.setattr(serve_module, "_configure_logging", lambda log_format, verbose: None)
    for name, value in env.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert main(["serve", "--parallel", "8", *args]) == 2
    return seen[0]


@pytest.mark.parametrize(
    "args,env,want",
    [([], None, None), (["--prefill-batch", "3"], None, 3), ([], "5", 5), (["--prefill-batch", "2"], "5", 2)],
)
def test_prefill_batch_reaches_the_engine(monkeypatch, args, env, want):
    """--prefill-batch / MLXCEL_PREFILL_BATCH: the engine's prefill_batch_size (None: the backend's default)."""
    config = _served_config(monkeypatch, args, {"MLXCEL_PREFILL_BATCH": env})
    assert config.engine.prefill_batch_size == want and config.engine.max_batch_size == 8


@pytest.mark.parametrize(
    "args,env,want", [([], None, True), (["--no-warmup"], None, False), ([], "0", False), (["--warmup"], "0", True)]
)
def test_warmup_reaches_the_server(monkeypatch, args, env, want):
    """On by default (the first client should not wait for kernel compiles); --no-warmup / MLXCEL_WARMUP=0."""
    assert _served_config(monkeypatch, args, {"MLXCEL_WARMUP": env}).warmup is want
