"""Checks every model family's test runs on its tiny checkpoint, beyond parity.assert_parity.

- assert_engine_paths: the engine's fast paths (batched decode of mixed-length prompts, dense and paged storage,
  chunked prefill, prompts prefilled together) give each prompt the greedy tokens of the plain path (dense storage,
  one prompt at a time), which parity holds equal to transformers.
- assert_quantized: 4- and 8-bit copies (the project's quantize_checkpoint): the quantized layers compute the
  dequantized fp32 architecture, and the batched paged path gives the plain path's tokens on them too.
- assert_cli_and_server: `mlxcel generate -m DIR --json` and the server's /v1/completions give transformers' greedy
  continuation of a text prompt (the tokenizer, the CLI and the server's request path included).

Random weights put the special tokens (ids 0-2 of the tiny tokenizer) anywhere, so the CLI and server checks
suppress them and transformers' reference does the same (`suppress_tokens`).
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import numpy as np
from parity import dequantized_logits, load_quiet, logits, prompt_ids, reference_model

# Mixed lengths: one longer than small windows and chunks, one of a single token, two in between.
LENGTHS = (23, 1, 9, 40)
BITS = (4, 8)  # the quantized copies a family's test_quantized checks, one parametrized test each
STEPS = 40
TEXT = "The capital of France is Paris. A quick brown fox jumps over the lazy dog"
SPECIAL = (0, 1, 2)


def _run(loaded, prompts: list[list[int]], steps: int, **config) -> list[list[int]]:
    """Greedy tokens of every prompt, all opened at once on one engine (EOS ignored)."""
    from mlxcel_core.engine import Engine, EngineConfig
    from mlxcel_core.sampling import SamplingParams

    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(**config))
    ids = {engine.open(p, SamplingParams(max_tokens=steps)): i for i, p in enumerate(prompts)}
    tokens: list[list[int]] = [[] for _ in prompts]
    while engine.has_work():
        for out in engine.step():
            assert out.error is None, out.error
            if out.token is not None:
                tokens[ids[out.seq_id]].append(out.token)
    return tokens


def engine_paths_tokens(loaded, prompts: list[list[int]], steps: int = STEPS) -> dict[str, list[list[int]]]:
    """Each engine path's greedy tokens for `prompts`; "plain" runs one prompt at a time on dense storage."""
    loaded.tokenizer.eos_token_ids = set()
    plain = [_run(loaded, [p], steps, max_batch_size=1, storage="dense", compile_decode=False)[0] for p in prompts]
    # whole prompts a forward on the batched paths (whatever the backend's chunk); the chunked path sets its own
    batch = dict(max_batch_size=len(prompts), compile_decode=False, prefill_chunk_size=2048)
    paged = dict(storage="paged", block_size=8, prefix_cache=False, **batch)
    one_by_one = dict(prefill_batch_size=1, **paged)
    return {
        "plain": plain,
        "dense batched": _run(loaded, prompts, steps, storage="dense", **batch),
        "paged batched": _run(loaded, prompts, steps, **one_by_one),
        "paged chunked prefill": _run(loaded, prompts, steps, **{**one_by_one, "prefill_chunk_size": 8}),
        "paged prefilled together": _run(loaded, prompts, steps, prefill_batch_size=len(prompts), **paged),
        "paged compiled": _run(loaded, prompts, steps, **{**one_by_one, "compile_decode": True}),
    }


def assert_engine_paths(path: Path, steps: int = STEPS) -> None:
    loaded = load_quiet(path)
    prompts = [prompt_ids(n, vocab=min(loaded.model.args.vocab_size, 320), seed=i) for i, n in enumerate(LENGTHS)]
    runs = engine_paths_tokens(loaded, prompts, steps)
    plain = runs.pop("plain")
    assert all(len(t) == steps for t in plain)
    for name, tokens in runs.items():
        for i, (got, want) in enumerate(zip(tokens, plain)):
            assert got == want, f"{name}: prompt {i} ({LENGTHS[i]} tokens) differs from the plain path"


def assert_quantized(path: Path, tmp_path: Path, bits: tuple[int, ...] = BITS, steps: int = 16) -> None:
    """Each `bits` copy: logits within 1e-4 of the fp32 architecture on its dequantized weights, and the batched
    paged path's greedy tokens equal to the plain path's."""
    from mlxcel_core.quantize import quantize_checkpoint

    for b in bits:
        dst = quantize_checkpoint(path, tmp_path / f"q{b}", bits=b, group_size=64)
        loaded = load_quiet(dst)
        np.testing.assert_allclose(
            logits(loaded.model), dequantized_logits(path, loaded.model), atol=1e-4, rtol=0, err_msg=f"{b}-bit"
        )
        prompts = [prompt_ids(n, vocab=min(loaded.model.args.vocab_size, 320), seed=i) for i, n in enumerate(LENGTHS)]
        loaded.tokenizer.eos_token_ids = set()
        plain = [_run(loaded, [p], steps, max_batch_size=1, storage="dense")[0] for p in prompts]
        paged = _run(loaded, prompts, steps, max_batch_size=len(prompts), storage="paged", block_size=8)
        assert paged == plain, f"{b}-bit: batched paged tokens differ from the plain path's"


def transformers_continuation(path: Path, text: str = TEXT, steps: int = STEPS) -> tuple[list[int], str]:
    """transformers' greedy tokens after `text` (tokenized without special tokens), the special tokens suppressed."""
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = reference_model(path)
    ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
    with torch.no_grad():
        out = model.generate(
            ids,
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            suppress_tokens=list(SPECIAL),
        )
    tokens = out[0, ids.shape[1] :].tolist()
    return tokens, tokenizer.decode(tokens)


def cli_tokens(path: Path, text: str = TEXT, steps: int = STEPS) -> dict:
    """`mlxcel generate -m DIR --json` on a raw prompt, in this process."""
    from mlxcel_cli.main import main

    suppress = [arg for t in SPECIAL for arg in ("--suppress-token", str(t))]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(
            ["generate", "-m", str(path), "-p", text, "--no-chat-template", "--json", "-n", str(steps), *suppress]
        )
    assert code == 0, out.getvalue()
    return json.loads(out.getvalue())


def server_text(path: Path, text: str = TEXT, steps: int = STEPS) -> str:
    """The server's /v1/completions text for `text` at temperature 0 (batch of 4 allowed, paged storage)."""
    from servers import start_server

    server = start_server(path, max_batch_size=4)
    try:
        with server.client() as client:
            body = {
                "model": server.model_id,
                "prompt": text,
                "max_tokens": steps,
                "temperature": 0,
                "logit_bias": {str(t): -100 for t in SPECIAL},
            }
            response = client.post("/v1/completions", json=body, headers=server.auth_headers())
            assert response.status_code == 200, response.text
            choice = response.json()["choices"][0]
            assert choice["finish_reason"] == "length"
            return choice["text"]
    finally:
        server.stop()


def assert_cli_and_server(path: Path, steps: int = STEPS) -> None:
    want_tokens, want_text = transformers_continuation(path, steps=steps)
    got = cli_tokens(path, steps=steps)
    assert got["token_ids"] == want_tokens, "mlxcel generate --json differs from transformers"
    assert server_text(path, steps=steps) == want_text, "the server's completion differs from transformers"
