"""mlx_layout.py: shards named and sized as mlx-lm names and sizes them, and a sharded directory loads back."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
from parity import load_quiet, logits

from mlxcel_core.mlx_layout import make_shards, save_config, save_weights, total_parameters


def test_make_shards_keeps_order_and_gives_a_large_tensor_its_own_shard():
    weights = {"a": mx.zeros((10,)), "b": mx.zeros((10,)), "big": mx.zeros((100,)), "c": mx.zeros((5,))}
    shards = make_shards(weights, max_bytes=80)
    assert [list(s) for s in shards] == [["a", "b"], ["big"], ["c"]]


def test_sharded_directory_loads_back(tiny_llama_dir, tmp_path):
    want = logits(load_quiet(tiny_llama_dir).model)
    model = load_quiet(tiny_llama_dir).model
    parameters = total_parameters(model)
    size, counted = save_weights(model, tmp_path, log=lambda _: None, max_bytes=100_000)
    assert counted == parameters
    names = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(names) > 1 and names[0] == f"model-00001-of-{len(names):05d}.safetensors"
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == size
    assert sorted(set(index["weight_map"].values())) == names
    assert list(index["weight_map"]) == sorted(index["weight_map"])
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    save_config({**config, "_name_or_path": "x", "quantization": {"group_size": 64, "bits": 4}}, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert "_name_or_path" not in written and written["quantization_config"] == written["quantization"]
    assert list(written) == sorted(written)
    save_config(config, tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_llama_dir / name, tmp_path / name)
    np.testing.assert_array_equal(logits(load_quiet(tmp_path).model), want)
