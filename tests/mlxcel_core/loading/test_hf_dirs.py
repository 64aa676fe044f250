"""Hugging Face directories: single file, sharded, shards missing from the index, MLX-quantized, broken."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlxcel_core.errors import CorruptModelError, InputError, UnsupportedModelError
from mlxcel_core.loading import load_model

PROMPT = mx.array([[5, 17, 42, 99, 3, 250, 7]])


def quiet(path, warnings=None):
    return load_model(str(path), log=(warnings.append if warnings is not None else lambda m: None))


def logits(lm):
    return np.array(lm.model(PROMPT))


def copy_dir(src, dst):
    shutil.copytree(src, dst)
    return dst


def shard(path, names_per_file: int = 6):
    """Split model.safetensors into shards with an index, as transformers does for big models."""
    weights = mx.load(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    keys = sorted(weights)
    weight_map = {}
    chunks = [keys[i : i + names_per_file] for i in range(0, len(keys), names_per_file)]
    for n, chunk in enumerate(chunks):
        name = f"model-{n + 1:05d}-of-{len(chunks):05d}.safetensors"
        mx.save_safetensors(str(path / name), {k: weights[k] for k in chunk})
        weight_map.update({k: name for k in chunk})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return sorted(set(weight_map.values()))


def test_sharded_checkpoint_equals_single_file(tiny_llama_dir, tmp_path):
    reference = logits(quiet(tiny_llama_dir))
    path = copy_dir(tiny_llama_dir, tmp_path / "sharded")
    assert len(shard(path)) > 1
    np.testing.assert_array_equal(logits(quiet(path)), reference)


def test_index_naming_missing_files_loads_the_shards_present(tiny_llama_dir, tmp_path):
    reference = logits(quiet(tiny_llama_dir))
    path = copy_dir(tiny_llama_dir, tmp_path / "stale-index")
    shard(path)
    # Re-save the same tensors under one new name; the index still names the old shards.
    present = {}
    for f in sorted(path.glob("model-*.safetensors")):
        present.update(mx.load(str(f)))
        f.unlink()
    mx.save_safetensors(str(path / "weights.safetensors"), present)
    warnings: list[str] = []
    np.testing.assert_array_equal(logits(quiet(path, warnings)), reference)
    assert any("missing shard" in w for w in warnings)


def test_missing_tensor_is_a_clear_error(tiny_llama_dir, tmp_path):
    path = copy_dir(tiny_llama_dir, tmp_path / "partial")
    weights = mx.load(str(path / "model.safetensors"))
    weights.pop("model.norm.weight")
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    with pytest.raises(CorruptModelError, match="missing tensors model.norm.weight"):
        quiet(path)


@pytest.mark.parametrize("bits", [4, 8])
def test_mlx_quantized_directory(tiny_llama_dir, tmp_path, bits):
    """A directory quantized the mlx-lm way (config `quantization`, packed weights + scales/biases). The in-memory
    reference is quantized as the backend's preparation undone, then prepared again, as load_model prepares it."""
    from mlxcel_core import backends

    source = quiet(tiny_llama_dir)
    backends.current().unprepare_model(source.model)
    nn.quantize(source.model, group_size=32, bits=bits)
    backends.current().prepare_model(source.model)
    path = copy_dir(tiny_llama_dir, tmp_path / f"q{bits}")
    (path / "model.safetensors").unlink()
    flat = dict(tree_flatten(source.model.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), flat)
    config = json.loads((path / "config.json").read_text())
    config["quantization"] = {"group_size": 32, "bits": bits}
    (path / "config.json").write_text(json.dumps(config))

    loaded = quiet(path)
    assert isinstance(loaded.model.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    assert loaded.model.model.layers[0].self_attn.q_proj.bits == bits
    np.testing.assert_array_equal(logits(loaded), logits(source))


def test_broken_inputs_give_specific_errors(tiny_llama_dir, tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        quiet(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="no config.json"):
        quiet(tmp_path / "empty")

    path = copy_dir(tiny_llama_dir, tmp_path / "other-type")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "bert"}))
    with pytest.raises(UnsupportedModelError, match="model_type 'bert' is not supported"):
        quiet(path)

    path = copy_dir(tiny_llama_dir, tmp_path / "truncated")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptModelError, match="model.safetensors"):
        quiet(path)


def test_the_first_run_on_a_gpu_says_it_is_compiling_kernels(tiny_llama_dir, tmp_path, monkeypatch):
    """An empty kernel cache (a new machine, GPU or MLX version) means a minute of compiles before the first token:
    said once, on the load's log, with where they will be kept; not again once the cache holds anything."""
    import mlxcel_core.loading.load as load

    kernels = tmp_path / "kernels"
    kernels.mkdir()
    monkeypatch.setattr(load, "use_kernel_cache", lambda: kernels)
    said = []
    quiet(tiny_llama_dir, said)
    assert [m for m in said if "compiling CUDA kernels" in m and str(kernels) in m] and len(said) == 1
    (kernels / "a.cubin").write_bytes(b"x")
    said.clear()
    quiet(tiny_llama_dir, said)
    assert not said
    monkeypatch.setattr(load, "use_kernel_cache", lambda: tmp_path / "not-yet")  # a user's MLX_PTX_CACHE_DIR
    quiet(tiny_llama_dir, said)
    assert len(said) == 1 and "compiling CUDA kernels" in said[0]
    said.clear()
    monkeypatch.setattr(load, "use_kernel_cache", lambda: None)  # CPU, Metal: nothing to compile or keep
    quiet(tiny_llama_dir, said)
    assert not said


def test_bad_input_on_a_first_gpu_run_says_only_the_error(tmp_path, monkeypatch):
    """The compile notice comes once the model is read: a bad path stays the one-line error the CLI prints."""
    import mlxcel_core.loading.load as load

    monkeypatch.setattr(load, "use_kernel_cache", lambda: tmp_path / "kernels-not-yet")
    said = []
    with pytest.raises(InputError, match="does not exist"):
        quiet(tmp_path / "nope", said)
    assert not said
