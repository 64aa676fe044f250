"""On the CPU a quantized model with half-precision scales computes in float32 (loading/weights.py's
float32_on_cpu): a bfloat16 4-bit checkpoint loads with float32 scales and activations, `mlxcel generate` gives the
greedy tokens of the fp32 architecture run on its dequantized weights, and `convert` still copies it as it is."""

from __future__ import annotations

import contextlib
import io

import mlx.core as mx
import numpy as np
import pytest
from family_checks import SPECIAL, STEPS, TEXT, cli_tokens
from mlx.utils import tree_flatten
from parity import load_quiet, prompt_ids
from tiny_models import save_tiny_llama

from mlxcel_cli.main import main
from mlxcel_core.loading.shapes import build_random_model

pytestmark = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the CPU's rule (a GPU keeps the dtypes)")


def _cli(*args: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue() + err.getvalue()


@pytest.fixture(scope="module")
def bf16_q4(tmp_path_factory):
    root = tmp_path_factory.mktemp("cpu-f32")
    src = save_tiny_llama(root / "src")
    code, out = _cli("convert", str(src), "-o", str(root / "q4"), "-q", "--dtype", "bfloat16")
    assert code == 0, out
    return src, root / "q4"


def _dtypes(model) -> set[str]:
    return {str(v.dtype) for k, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)}


def _dequantized_fp32(src, q4):
    """The fp32 architecture (the source loaded) holding the file's weights dequantized in float32 (dequantizing
    with bfloat16 scales would round every weight to bfloat16)."""
    stored = mx.load(str(q4 / "model.safetensors"))
    weights = {}
    for name, value in stored.items():
        base = name.rsplit(".", 1)[0]
        if name.endswith((".scales", ".biases")):
            continue
        if f"{base}.scales" in stored:
            scales, biases = (stored[f"{base}.{part}"].astype(mx.float32) for part in ("scales", "biases"))
            value = mx.dequantize(value, scales, biases, group_size=64, bits=4)  # q * scale + bias, exactly
        weights[name] = value.astype(mx.float32)
    model = load_quiet(src).model
    model.load_weights(list(weights.items()), strict=True)
    return model


def _greedy(model, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    for _ in range(steps):  # no cache: the plainest computation; special tokens suppressed as cli_tokens does
        last = model(mx.array([ids]))[0, -1]
        last[mx.array(list(SPECIAL))] = -mx.inf
        ids.append(int(mx.argmax(last).item()))
    return ids[len(prompt) :]


def test_a_bfloat16_4bit_checkpoint_computes_in_float32(bf16_q4):
    src, q4 = bf16_q4
    stored = mx.load(str(q4 / "model.safetensors"))
    assert {str(v.dtype) for k, v in stored.items() if k.endswith(".scales")} == {"mlx.core.bfloat16"}
    loaded = load_quiet(q4)
    assert _dtypes(loaded.model) == {"mlx.core.float32"}
    reference = _dequantized_fp32(src, q4)
    prompt = prompt_ids(12)
    ours = np.array(loaded.model(mx.array([prompt])))
    np.testing.assert_allclose(ours, np.array(reference(mx.array([prompt]))), atol=1e-4, rtol=0)

    result = cli_tokens(q4)
    assert result["token_ids"] == _greedy(reference, loaded.tokenizer.encode(TEXT), STEPS)


def test_convert_keeps_the_sources_dtypes(bf16_q4, tmp_path):
    _, q4 = bf16_q4
    code, out = _cli("convert", str(q4), "-o", str(tmp_path / "copy"))
    assert code == 0, out
    stored = mx.load(str(tmp_path / "copy" / "model.safetensors"))
    assert {str(v.dtype) for k, v in stored.items() if k.endswith(".scales")} == {"mlx.core.bfloat16"}


def test_a_random_4bit_shape_computes_as_a_loaded_checkpoint_does():
    model, _ = build_random_model("tiny", bits=4, dtype="bfloat16")
    assert _dtypes(model) == {"mlx.core.float32"}
    unquantized, _ = build_random_model("tiny", dtype="bfloat16")  # only quantized models: bf16 stays bf16
    assert _dtypes(unquantized) == {"mlx.core.bfloat16"}
