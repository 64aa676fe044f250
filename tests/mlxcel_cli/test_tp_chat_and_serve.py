"""`mlxcel run` and `mlxcel serve` with `--tp-size 2` (2 local ranks over the ring backend on 127.0.0.1).

Rank 0 chats or serves HTTP; rank 1 mirrors its engine (distributed/mirror.py). The replies must be the
single-process replies token for token; Ctrl-C in the terminal interrupts a reply on every rank and the
chat goes on; on SIGINT the server shuts down gracefully on every rank (status 130, as without --tp-size).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pexpect
import pytest
from ranks import two_ranks_here
from tiny_models import save_tiny_llama

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 120
NO_EOS = ["--suppress-token", "0", "--suppress-token", "1", "--suppress-token", "2"]
LISTENING = re.compile(r"listening on http://127\.0\.0\.1:(\d+)")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tp-chat-llama"))


def _run_piped(llama, *extra):
    return subprocess.run(
        [sys.executable, "-m", "mlxcel_cli.main", "run", "-m", str(llama), "-n", "12", *NO_EOS, *extra],
        input="Hello there\n/set temp 0.8\n/set seed 5\nTell me more\n",
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


@two_ranks_here
def test_run_tp2_chat_replies_equal_single_process(llama):
    single = _run_piped(llama)
    parallel = _run_piped(llama, "--tp-size", "2")
    assert single.returncode == 0 and parallel.returncode == 0, parallel.stderr
    assert len(single.stdout.splitlines()) == 2  # a greedy turn, then a seeded sampled one
    assert parallel.stdout == single.stdout
    assert "tensor parallel: 2 ranks" in parallel.stderr


@two_ranks_here
def test_run_tp2_ctrl_c_interrupts_the_reply_on_every_rank(tmp_path):
    endless = save_tiny_llama(tmp_path / "endless", eos_token_id=None, max_position_embeddings=65536)
    config = json.loads((endless / "tokenizer_config.json").read_text())
    (endless / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": None}))
    child = pexpect.spawn(
        sys.executable,
        ["-m", "mlxcel_cli.main", "run", str(endless), "-n", "60000", "-v", "--tp-size", "2"],
        cwd=str(ROOT),
        env={**os.environ, "TERM": "xterm-256color"},
        encoding="utf-8",
        codec_errors="replace",
        timeout=TIMEOUT,
        dimensions=(40, 200),
    )
    try:
        child.expect_exact(">>> ")
        child.sendline("Hello world")
        child.expect_exact("Hello world")
        child.expect(r"[\s\S]{100}")  # streaming
        child.sendintr()  # reaches both ranks (one foreground process group); rank 0 cancels, rank 1 follows
        child.expect_exact("[interrupted]")
        child.expect_exact(">>> ")
        child.sendline("/set max-tokens 4")
        child.expect_exact(">>> ")
        child.sendline("Again")
        child.expect(r"reply 4 tokens")  # the ranks are still in step
        child.expect_exact(">>> ")
        child.sendeof()
        child.expect(pexpect.EOF, timeout=30)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, child.before


class _Server:
    def __init__(self, llama, tmp_path, *args):
        self.path = tmp_path / f"serve-{len(args)}.log"
        self.log = open(self.path, "w")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mlxcel_cli.main",
                "serve",
                "-m",
                str(llama),
                "--port",
                "0",
                "--parallel",
                "4",
                *args,
            ],
            cwd=str(ROOT),
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + TIMEOUT
        while not (match := LISTENING.search(self.output())):
            assert time.monotonic() < deadline and self.proc.poll() is None, self.output()
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{match.group(1)}"
        while httpx.get(f"{self.url}/health", timeout=5).status_code != 200:
            assert time.monotonic() < deadline and self.proc.poll() is None, self.output()
            time.sleep(0.05)

    def output(self) -> str:
        return self.path.read_text()

    def completions(self, prompts):
        """All prompts at once (concurrent requests, batched by the engine); greedy token text per prompt."""
        results = {}

        def ask(i, prompt):
            body = {
                "prompt": prompt,
                "max_tokens": 10 + 3 * i,
                "temperature": 0,
                "logit_bias": {"0": -100, "1": -100, "2": -100},
            }
            reply = httpx.post(f"{self.url}/v1/completions", json=body, timeout=TIMEOUT)
            results[i] = (reply.status_code, reply.json()["choices"][0]["text"])

        threads = [threading.Thread(target=ask, args=item) for item in enumerate(prompts)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT)
        return [results[i] for i in range(len(prompts))]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.log.close()


@two_ranks_here
def test_serve_tp2_concurrent_requests_equal_single_process(llama, tmp_path):
    prompts = ["The capital of France", "Once upon a time there was", "1 2 3 4", "A quick brown fox jumps over"]
    single = _Server(llama, tmp_path)
    try:
        expected = single.completions(prompts)
    finally:
        assert single.stop() == 130  # Ctrl-C: graceful shutdown, the documented 'interrupted' status
    parallel = _Server(llama, tmp_path, "--tp-size", "2")
    try:
        got = parallel.completions(prompts)
        again = parallel.completions(prompts[:2])  # the followers are still in step after a round
    finally:
        code = parallel.stop()
    assert all(status == 200 for status, _ in expected)
    assert got == expected
    assert again == expected[:2]
    assert code == 130, parallel.output()
    assert "Traceback" not in parallel.output() and "mlxcel: error" not in parallel.output()
