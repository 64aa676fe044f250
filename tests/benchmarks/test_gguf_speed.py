"""benchmarks/gguf_speed.py at test size: a Q4_K GGUF written by ggml's quantizer and its MLX 4-bit group-32
conversion both load through `mlxcel bench -m`'s path and decode; the two read the same weight bytes a step."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("libgguf")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import gguf_speed  # noqa: E402


def test_both_formats_decode_and_read_the_same_bytes(tmp_path, capsys):
    argv = ["--model-shape", "llama-3.2-1b", "--scaled", "--gen-tokens", "4", "--reps", "2", "--json"]
    assert gguf_speed.main([*argv, "--work-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["gguf_tok_s"] > 0 and result["mlx_tok_s"] > 0
    assert result["ratio"] == pytest.approx(result["gguf_tok_s"] / result["mlx_tok_s"], rel=0.01)
    # auto dtype: the MLX checkpoint keeps scales in the dtype the GGUF path uses, so the bytes are the same
    assert result["gguf_step_bytes"] == result["mlx_step_bytes"] > 0
    assert result["gguf_dtypes"] == result["mlx_dtypes"]
    assert result["gguf_model"].endswith(" Q4") and result["mlx_model"].endswith(" Q4")
    assert "ratio GGUF / MLX:" in out
    from gguf import GGMLQuantizationType, GGUFReader

    kinds = {t.tensor_type for t in GGUFReader(tmp_path / "model-q4_k.gguf").tensors if len(t.shape) == 2}
    assert kinds == {GGMLQuantizationType.Q4_K}  # every matrix, the embedding included
    config = json.loads(next(tmp_path.glob("model-mlx-q4-g32-*/config.json")).read_text())
    assert config["quantization"]["bits"] == 4 and config["quantization"]["group_size"] == 32


@pytest.mark.parametrize(
    "shape, message",
    [
        ("smollm2-135m", "Q4_K needs row lengths that are multiples of 256: hidden_size 576"),
        ("qwen3.5-9b", "must be a llama-family shape"),
    ],
)
def test_shapes_q4_k_cannot_hold_are_refused(shape, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        gguf_speed.main(["--model-shape", shape])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("gguf_speed: ") and err.count("\n") == 1, err
    assert message in err
