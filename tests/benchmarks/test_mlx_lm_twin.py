"""benchmarks/mlx_lm_twin.py: mlx-lm's model of each shape's family, on mlxcel's arrays, computes mlxcel's logits.

Each family is checked at test size (benchmarks/scaled_shapes.py) in float32 with random norms and biases, its
weights quantized to 4 bits as the H200 runs quantize them: mlx-lm's full-prompt logits and its own cached decode
steps against mlxcel's. The comparison scripts are driven through their main() at that size. Skipped where mlx-lm is
not importable (it is the benchmarks' peer, not a dependency: PYTHONPATH or pip install mlx-lm)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("mlx_lm")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import mlx.core as mx  # noqa: E402
import mlx_lm_twin  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm_twin import (  # noqa: E402
    ARCH_TOLERANCE,
    TwinMismatch,
    TwinUnavailable,
    build_twin,
    compare_logits,
    mlx_lm_kv_bytes_per_token,
    verify_architecture,
)
from scaled_shapes import scaled_down  # noqa: E402

from mlxcel_core.engine.budget import kv_bytes_per_token  # noqa: E402
from mlxcel_core.loading.shapes import SHAPES, build_random_model, shape_config  # noqa: E402

# One shape per model_type (the families the H200 comparisons cover).
FAMILIES = list({config["model_type"]: name for name, config in SHAPES.items() if name != "tiny"}.values())


def small_pair(shape: str, bits: int | None = 4, dtype: str = "float32"):
    config, _ = scaled_down(shape_config(shape))
    ours, config = build_random_model(shape, bits=bits, dtype=dtype, config=config)
    return ours, build_twin(ours, config), config


@pytest.mark.parametrize("shape", FAMILIES)
def test_twin_computes_the_same_model(shape):
    line = verify_architecture(shape, bits=4)
    assert line.startswith(f"float32 scaled-down {shape}") and "agrees" in line


def test_twin_holds_our_arrays():
    ours, theirs, _ = small_pair("gpt-oss-20b")
    mine = {id(v) for _, v in tree_flatten(ours.parameters())}
    theirs_arrays = [v for _, v in tree_flatten(theirs.parameters())]
    assert theirs_arrays and all(id(v) in mine for v in theirs_arrays)
    assert "0.0 MiB of them not mlxcel's own arrays" in mlx_lm_twin.describe_sharing(ours, theirs)


def test_a_changed_weight_fails_the_check():
    ours, theirs, config = small_pair("moonlight-16b-a3b", bits=None)
    norm = theirs.model.layers[1].self_attn.kv_a_layernorm
    norm.weight = norm.weight * 1.5
    agreement = compare_logits(ours, theirs, config["vocab_size"])
    with pytest.raises(TwinMismatch, match="do not compute the same model"):
        agreement.check(ARCH_TOLERANCE)


def test_mla_caches_the_latent_in_both_runtimes():
    ours, theirs, config = small_pair("moonlight-16b-a3b", bits=None, dtype="bfloat16")
    latent = config["num_hidden_layers"] * (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * 2
    assert kv_bytes_per_token(ours, dtype_bytes=2) == latent
    assert mlx_lm_kv_bytes_per_token(theirs) == latent


def test_families_mlx_lm_cannot_compare_are_refused(monkeypatch):
    ours, _, config = small_pair("llama-3.2-1b", bits=None)
    with pytest.raises(TwinUnavailable, match="has no model for model_type 'no_such_family'"):
        build_twin(ours, {**config, "model_type": "no_such_family"})
    monkeypatch.setitem(mlx_lm_twin.NOT_COMPARABLE, "llama", "a stand-in reason")
    with pytest.raises(TwinUnavailable, match="computes a different model: a stand-in reason"):
        build_twin(ours, config)


def test_compare_mlx_lm_script_at_test_size(capsys):
    import compare_mlx_lm

    argv = ["--model-shape", "llama-4-scout", "--scale-down", "--bits", "4", "--prompt-tokens", "8"]
    assert compare_mlx_lm.main([*argv, "--gen-tokens", "2", "--rounds", "1", "--json"]) == 0
    out = capsys.readouterr()
    result = json.loads(out.out)
    assert "scaled down" in result["model"] and result["relative_logit_diff"] <= mlx_lm_twin.HALF_TOLERANCE
    assert result["mlxcel_decode_tps_median"] > 0 and result["mlx-lm_decode_tps_median"] > 0
    assert "float32 scaled-down llama-4-scout (random norms and biases) agrees" in out.err
    assert "mlx-lm differs, beyond rounding: mlx-lm's q/k L2 norm takes eps 1e-6" in out.err
    # (on the CPU ours computes this bfloat16 4-bit model in float32, mlx-lm in bfloat16: loading/weights.py)
    ours = 2048 if mx.default_device() == mx.cpu else 1024
    assert f"KV cache bytes per token: mlxcel {ours}, mlx-lm 1024" in out.err


def test_compare_mlx_lm_script_skips_what_mlx_lm_cannot_compare(capsys, monkeypatch):
    import compare_mlx_lm

    monkeypatch.setitem(mlx_lm_twin.NOT_COMPARABLE, "gpt_oss", "a stand-in reason")
    assert compare_mlx_lm.main(["--model-shape", "gpt-oss-20b", "--scale-down", "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["skipped"].endswith("a stand-in reason")
    assert "SKIPPED gpt-oss-20b" in out.err


def test_compare_mlx_lm_script_fails_when_logits_differ(capsys, monkeypatch):
    import compare_mlx_lm

    def twin_with_a_wrong_norm(ours, config, dtype=None):
        theirs = build_twin(ours, config, dtype)
        norm = theirs.model.layers[0].input_layernorm
        norm.weight = norm.weight * 2
        return theirs

    monkeypatch.setattr(compare_mlx_lm, "build_twin", twin_with_a_wrong_norm)
    argv = ["--model-shape", "smollm3-3b", "--scale-down", "--dtype", "float32", "--no-arch-check"]
    assert compare_mlx_lm.main([*argv, "--rounds", "1"]) == 1
    assert "compare_mlx_lm: error: mlxcel vs mlx-lm: logits differ beyond tolerance" in capsys.readouterr().err


def test_batch_decode_script_at_test_size(capsys):
    import batch_decode

    argv = ["--model-shape", "glm-4.5-air", "--scale-down", "--bits", "4", "--batches", "1,2"]
    assert batch_decode.main([*argv, "--prompt-tokens", "8", "--gen-tokens", "2", "--reps", "1"]) == 0
    out = capsys.readouterr().out
    assert "float32 scaled-down glm-4.5-air (random norms and biases) agrees" in out
    ours = 2048 if mx.default_device() == mx.cpu else 1024  # (float32 on the CPU: see the test above)
    assert f"KV cache bytes per token: mlxcel {ours}, mlx-lm 1024" in out and "| mlxcel / mlx-lm | 2 |" in out


def test_batch_generator_cannot_batch_llama4():
    _, theirs, _ = small_pair("llama-4-scout", bits=None)
    refusal = mlx_lm_twin.batch_generator_refusal(theirs)
    assert refusal and refusal.endswith("BatchGenerator cannot batch this model: its ChunkedKVCache has no merge")
    assert mlx_lm_twin.batch_generator_refusal(small_pair("gpt-oss-20b", bits=None)[1]) is None


def test_scaled_down_keeps_every_key():
    for name in FAMILIES:
        full = shape_config(name)
        small, summary = scaled_down(full)
        assert small.keys() == full.keys() and summary.startswith("scaled down (")
        assert small["hidden_size"] == 256 and small["num_hidden_layers"] < full["num_hidden_layers"]
