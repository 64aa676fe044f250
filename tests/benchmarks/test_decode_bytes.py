"""benchmarks/decode_bytes.py: the bytes a batch-1 decode step reads, against a count by hand from Llama-3-8B's
published sizes; the tied LM head counted; families it does not cover refused."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import decode_bytes  # noqa: E402


def q4_bytes(out_features: int, in_features: int) -> int:
    """An MLX 4-bit affine matrix, groups of 64, bf16 scales and biases: packed words + scales + biases."""
    return out_features * in_features // 2 + 2 * out_features * (in_features // 64) * 2


def test_llama_3_8b_4bit_by_hand(capsys):
    hidden, inter, kv_dim, vocab, layers = 4096, 14336, 1024, 128256, 32
    layer = q4_bytes(hidden, hidden) * 2 + q4_bytes(kv_dim, hidden) * 2  # q, o; k, v
    layer += q4_bytes(inter, hidden) * 2 + q4_bytes(hidden, inter)  # gate, up; down
    layer += 2 * hidden * 2  # the two RMSNorm weights (bf16)
    weights = layers * layer + hidden * 2 + q4_bytes(vocab, hidden)  # final norm, LM head
    kv = layers * 2 * kv_dim * 576 * 2  # mean context of 512 + 128 / 2 tokens, bf16
    config = decode_bytes.shape_config("llama-3-8b")
    counted = decode_bytes.step_bytes(decode_bytes.lazy_model(config, 4, "bfloat16"), config, 576, "bfloat16")
    assert counted == {"weights": weights, "embedding_left_out": q4_bytes(vocab, hidden), "kv": kv}
    args = ["--model-shape", "llama-3-8b", "--bits", "4", "--gen-tokens", "128", "--tok-s", "400"]
    assert decode_bytes.main(args) == 0
    out = capsys.readouterr().out
    assert f"weights a step reads: {weights / 1e9:.3f} GB" in out and f"KV attended over: {kv / 1e6:.1f} MB" in out
    limit = 4.3e12 / (weights + kv)
    assert f"the limit is {limit:.1f} tok/s" in out and f"{100 * 400 / limit:.1f}% of the limit" in out


def test_a_tied_lm_head_reads_the_embedding_table():
    config = decode_bytes.shape_config("llama-3.2-1b")
    assert config["tie_word_embeddings"]
    counted = decode_bytes.step_bytes(decode_bytes.lazy_model(config, None, "bfloat16"), config, 100, "bfloat16")
    assert counted["embedding_left_out"] == 0
    assert counted["weights"] > 128256 * 2048 * 2  # (the table's bytes are among the weights)
    untied = dict(config, tie_word_embeddings=False)
    split = decode_bytes.step_bytes(decode_bytes.lazy_model(untied, None, "bfloat16"), untied, 100, "bfloat16")
    assert split["embedding_left_out"] == 128256 * 2048 * 2 and split["weights"] == counted["weights"]


@pytest.mark.parametrize("shape", ["glm-4.5-air", "gpt-oss-20b", "qwen3.5-9b", "olmo-3-7b"])
def test_families_it_does_not_cover_are_refused(shape, capsys):
    assert decode_bytes.main(["--model-shape", shape, "--bits", "4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"decode_bytes.py: {shape}: ") and len(err.strip().splitlines()) == 1
