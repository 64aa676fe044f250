"""Parity harness shared by every model family's test: transformers (fp32, CPU) vs our loader + engine."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np

from conftest import CHATML, build_tokenizer


def save_tiny_checkpoint(path: Path, config_cls, model_cls, **config) -> Path:
    """Random fp32 checkpoint saved by transformers, plus the tiny test tokenizer (vocab 320)."""
    import torch

    tok = build_tokenizer()
    config.setdefault("vocab_size", tok.get_vocab_size())
    torch.manual_seed(0)
    model = model_cls(config_cls(**config)).eval()
    model.save_pretrained(path, safe_serialization=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "bos_token": None, "chat_template": CHATML}))
    return path


def prompt_ids(length: int, vocab: int = 320, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, size=length).tolist()


def reference(path: Path, prompt: list[int], steps: int):
    """transformers' logits for every prompt position and its greedy continuation (EOS ignored)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        logits = model(ids).logits[0].float().numpy()
        out = model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return logits, out[0, len(prompt):].tolist()


def ours(path: Path, prompt: list[int], steps: int):
    """Our logits (one forward, no cache) and greedy tokens through the engine, loaded like the CLI does."""
    from mlxcel_core.api import stream_generate
    from mlxcel_core.loading import load_model
    from mlxcel_core.sampling import SamplingParams

    loaded = load_model(str(path), log=lambda m: None)
    logits = np.array(loaded.model(mx.array([prompt])).astype(mx.float32))[0]
    loaded.tokenizer.eos_token_ids = set()
    tokens = [c.token for c in stream_generate(loaded, prompt, SamplingParams(max_tokens=steps)) if c.token is not None]
    return logits, tokens


def assert_parity(path: Path, prompt_len: int = 64, steps: int = 32, atol: float = 1e-4) -> None:
    prompt = prompt_ids(prompt_len)
    ref_logits, ref_tokens = reference(path, prompt, steps)
    logits, tokens = ours(path, prompt, steps)
    diff = float(np.abs(logits - ref_logits).max())
    assert diff <= atol, f"max-abs logit difference {diff:.3g} > {atol}"
    assert tokens == ref_tokens
