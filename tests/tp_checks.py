"""Tensor-parallel runs shared by the distributed tests: `mlxcel generate` in a subprocess, single and --tp-size N."""

from __future__ import annotations

import json
import os
import subprocess
import sys

TIMEOUT = 120
# The tiny checkpoints' common shape: 4 query heads over 2 KV heads split evenly over 2 ranks.
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    initializer_range=0.1,
)
# EOS and the other special tokens suppressed: random weights must still produce all N tokens.
GEN = [
    "--json",
    "--no-chat-template",
    "-n",
    "24",
    "--suppress-token",
    "0",
    "--suppress-token",
    "1",
    "--suppress-token",
    "2",
]


def mlxcel(*args, env=None, timeout=TIMEOUT):
    return subprocess.run(
        [sys.executable, "-m", "mlxcel_cli.main", *args],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
        timeout=timeout,
    )


def tokens(*args):
    result = mlxcel("generate", *args, *GEN)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["token_ids"]


def assert_tp_matches(path, prompt="The capital of France is Paris. A quick brown fox", tp=2):
    single = tokens("-m", str(path), "-p", prompt)
    parallel = tokens("-m", str(path), "-p", prompt, "--tp-size", str(tp))
    assert len(single) == 24
    assert parallel == single
